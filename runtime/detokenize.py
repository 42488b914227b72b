"""Token ids → text, whole characters only.

A byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's, SmolLM's) splits a character of several UTF-8
bytes — an emoji, a CJK character — over several tokens, and so does SentencePiece's byte fallback
(<0xF0><0x9F>...). The tokenizer's own decode writes the bytes of a character whose last bytes have not
come as U+FFFD: while tokens arrive those bytes are not text yet, and when a generation ends inside such
a character (max_tokens cut it) they never will be. `Detokenizer` leaves them out, as vLLM's and
llama-server's streams do (vLLM's incremental detokenizer holds back a text ending in U+FFFD and never
sends it; llama-server sends nothing while its text ends inside a UTF-8 character, and its last chunk
is empty). A U+FFFD the tokens spell out whole (its three bytes EF BF BD) is a character like any
other and stays, and so does one that stands for bytes no later byte could make a character of (a
lone continuation byte): only the unfinished start of a character at the very end is left out.
"""

from __future__ import annotations

import codecs
import functools
import json
import re

REPLACEMENT = "\ufffd"


class Detokenizer:
    """`tokenizer`'s text of token ids (those in `skipped` left out), ending at a whole character."""

    def __init__(self, tokenizer, skipped: frozenset[int] = frozenset()):
        self.tokenizer, self.skipped = tokenizer, frozenset(skipped)

    def __call__(self, tokens: list[int]) -> str:
        tokens = [t for t in tokens if t not in self.skipped]
        text = self._decode(tokens)
        if not text.endswith(REPLACEMENT):
            return text
        count, aligned = self.unfinished(tokens)
        if not count:
            return text
        if aligned:  # the unfinished bytes are whole tokens: the text before them (any tokenizer's)
            return self._decode(tokens[:-count])
        # it begins inside a token (a byte-level piece such as "Ġä"): byte-level decoding replaced
        # the unfinished bytes, a valid prefix of one character, with one U+FFFD
        return text[:-1]

    def unfinished(self, tokens: list[int]) -> tuple[int, bool]:
        """How the bytes of `tokens` end: (0, True) at a whole character, else the number of last
        tokens that hold the unfinished character's bytes, and whether they hold those bytes only."""
        pieces: list[bytes] = []
        for t in reversed(tokens):  # four bytes reach back to the start of any unfinished character
            pieces.insert(0, self._bytes(t))
            if sum(map(len, pieces)) >= 4:
                break
        data = b"".join(pieces)
        left = len(data) - codecs.utf_8_decode(data, "replace", False)[1]  # bytes held back: unfinished
        if not left:
            return 0, True
        count = held = 0
        while held < left:
            count += 1
            held += len(pieces[-count])
        return count, held == left

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _bytes(self, token: int) -> bytes:
        """The bytes `token` stands for: byte-level BPE's stand-in characters mapped back to bytes,
        SentencePiece's byte tokens (<0xNN>), else its text (an added token's is its content)."""
        if token in self._added:
            return self._added[token]
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        if self._byte_level and all(c in _byte_of_char() for c in piece):
            return bytes(_byte_of_char()[c] for c in piece)
        if self._byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode("utf-8")

    @functools.cached_property
    def _added(self) -> dict[int, bytes]:
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return {i: str(t).encode("utf-8") for i, t in added.items()}

    @functools.cached_property
    def _kinds(self) -> set[str]:
        """The decoders the tokenizer's text passes through (a fast tokenizer's; none known else)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        if decoder is None:
            return set()
        state = json.loads(decoder.__getstate__())
        return {d.get("type") for d in state.get("decoders", [state])}

    @property
    def _byte_level(self) -> bool:
        return "ByteLevel" in self._kinds

    @property
    def _byte_fallback(self) -> bool:
        return "ByteFallback" in self._kinds


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's table), inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}
