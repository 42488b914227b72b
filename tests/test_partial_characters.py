"""Never half a character: a generation cut inside a multi-byte UTF-8 character (max_tokens) ends at
the last whole character, in the text and in every streamed piece, through a real byte-level BPE
tokenizer (runtime/detokenize.py); a U+FFFD the tokens spell out whole is kept."""

import dataclasses
import threading

import pytest

from loopspec.runtime.detokenize import Detokenizer

from test_server import ServerThread, alone, httpx, make_app, pipe  # noqa: F401  (pipe: the lively tiny pair)

EMOJI = "\N{GRINNING FACE}"  # F0 9F 98 80
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0..2, as the tiny pair's (2 ends a reply)


def byte_level_tokenizer(byte_of_id: dict[int, int], merges: dict[int, bytes] = {}):
    """A real byte-level BPE tokenizer (the tokenizers library's BPE model, ByteLevel pre-tokenizer and
    decoder, as GPT-2, Llama 3, Qwen and SmolLM have): id i stands for byte byte_of_id[i], and each
    merged token merges[i] for its bytes (a BPE merge of two single bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()  # byte → its printable stand-in
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab |= {char[b]: i for i, b in byte_of_id.items()}
    vocab |= {"".join(char[b] for b in data): i for i, data in merges.items()}
    pairs = [(char[data[0]], char[data[1]]) for data in merges.values()]
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


# --------------------------------------------------------------------------------------------------
# The detokenizer against an independent oracle


TEXT = "a" + EMOJI + " " + EMOJI + "\u4f60\ufffdz\ufffd"  # 4-byte, 3-byte characters; two real U+FFFD


@pytest.fixture(scope="module")
def text_tokenizer():
    """Every byte of TEXT a token, and " " + F0 merged into one token (so one character's first byte
    shares a token with a whole character before it) → (the tokenizer, the bytes of each id)."""
    data = sorted(set(TEXT.encode()))
    byte_of_id, merged = {3 + i: b for i, b in enumerate(data)}, {3 + len(data): b" \xf0"}
    return byte_level_tokenizer(byte_of_id, merged), {i: bytes([b]) for i, b in byte_of_id.items()} | merged


def whole_characters(text_tokenizer, detokenize) -> None:
    """The text of every prefix of TEXT's tokens is the longest whole-character prefix of the bytes they
    stand for (the oracle: UTF-8 decoding that drops an unfinished last character, over the bytes the
    test gave each id), and at the end the whole of TEXT, its U+FFFDs included."""
    tokenizer, bytes_of = text_tokenizer
    ids = tokenizer.encode(TEXT)
    assert 2 * len(ids) > len(TEXT)  # the emoji and the CJK character take several tokens each
    assert tokenizer.convert_ids_to_tokens(ids[5:7]) == ["Ġð", "Ł"]  # the merged token is used
    for k in range(len(ids) + 1):
        known = b"".join(bytes_of[t] for t in ids[:k])
        assert detokenize(ids[:k]) == known.decode("utf-8", errors="ignore"), (k, detokenize(ids[:k]))
    assert detokenize(ids) == TEXT


def test_the_text_ends_at_a_whole_character(text_tokenizer):
    tokenizer = text_tokenizer[0]
    whole_characters(text_tokenizer, Detokenizer(tokenizer))
    # the tokenizer's own decode is what the oracle catches: half a character ends in U+FFFD
    with pytest.raises(AssertionError):
        whole_characters(text_tokenizer, lambda ids: tokenizer.decode(ids, clean_up_tokenization_spaces=False))


@pytest.mark.parametrize(
    "planted",
    [
        "unfinished bytes kept (the tokenizer's U+FFFD)",
        "every trailing U+FFFD dropped (the model's own too)",
        "the whole token dropped (the space before a split emoji too)",
    ],
)
def test_a_planted_bug_in_the_detokenizer_is_caught(text_tokenizer, monkeypatch, planted):
    if planted.startswith("unfinished bytes kept"):
        monkeypatch.setattr(Detokenizer, "unfinished", lambda self, tokens: (0, True))
    elif planted.startswith("every trailing"):
        monkeypatch.setattr(Detokenizer, "unfinished", lambda self, tokens: (1, False))
    else:
        real = Detokenizer.unfinished
        monkeypatch.setattr(Detokenizer, "unfinished", lambda self, tokens: (real(self, tokens)[0], True))
    with pytest.raises(AssertionError):
        whole_characters(text_tokenizer, Detokenizer(text_tokenizer[0]))


def test_sentencepiece_byte_fallback_ends_at_a_whole_character():
    """SentencePiece's byte tokens (<0xNN>): its decode writes a U+FFFD per byte of an unfinished run,
    whole characters before it included; the text is the run's whole characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = SPECIALS + ["▁a"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    detokenize = Detokenizer(tokenizer)
    ids = [3] + [4 + b for b in ("\u4f60" + EMOJI).encode()]
    assert tokenizer.decode(ids[:6]) == " a\ufffd\ufffd\ufffd\ufffd\ufffd"  # what the fix is for
    assert [detokenize(ids[:k]) for k in (1, 2, 4, 5, 6, 8)] == [" a", " a", " a\u4f60"] + [" a\u4f60"] * 2 + [
        " a\u4f60" + EMOJI
    ]


# --------------------------------------------------------------------------------------------------
# A real model's reply cut inside an emoji: the scheduler and the server over HTTP


@pytest.fixture(scope="module")
def cut(pipe):  # noqa: F811
    """A greedy reply of the tiny pair, and a byte-level tokenizer of its vocabulary under which the
    reply's tokens p..p+3 spell an emoji and the ones before plain ASCII: → (the pipeline with that
    tokenizer, the prompt, p, the reply's text up to the emoji)."""
    prompts = [[3 + (7 * i + j) % 120 for j in range(5)] for i in range(40)]
    for prompt in prompts:
        reply = alone(pipe, prompt, 12).tokens
        for p in range(1, 8):
            emoji = reply[p : p + 4]
            if len(set(emoji)) == 4 and not set(emoji) & set(reply[:p]) and not set(reply[: p + 4]) & {0, 1, 2}:
                break
        else:
            continue
        ascii_bytes = iter(range(0x21, 0x7F))
        byte_of_id = {t: next(ascii_bytes) for t in dict.fromkeys(reply[:p])}
        byte_of_id |= dict(zip(emoji, EMOJI.encode()))
        rest = iter(b for b in range(256) if b not in set(byte_of_id.values()))
        byte_of_id |= {i: next(rest) for i in range(3, pipe.engine.target_cfg.vocab_size) if i not in byte_of_id}
        tokenizer = byte_level_tokenizer(byte_of_id)
        before = bytes(byte_of_id[t] for t in reply[:p]).decode()
        assert tokenizer.decode(reply[: p + 2]) == before + "\ufffd"  # what the fix is for
        return dataclasses.replace(pipe, tokenizer=tokenizer), prompt, p, before
    pytest.fail("no greedy reply of the tiny pair has 4 new distinct tokens early on")


def scheduled(byte_pipe, prompt, max_tokens) -> tuple[list[str], str]:
    """The text pieces and the finish reason of one request through the scheduler."""
    from loopspec.runtime.decoder import Decoder
    from loopspec.runtime.scheduler import Request, Scheduler

    scheduler = Scheduler(
        Decoder(byte_pipe.engine.with_rows(2), byte_pipe.settings("dflash", adaptive=False)),
        byte_pipe.decode,
        stop_token_ids=byte_pipe.stop_token_ids,
    ).start()
    events, done = [], threading.Event()

    def collect(event):
        events.append(event)
        if event.kind in ("done", "error"):
            done.set()

    try:
        scheduler.submit(Request(prompt_ids=prompt, max_tokens=max_tokens, on_event=collect))
        assert done.wait(60)
    finally:
        scheduler.close()
    assert events[-1].kind == "done", events[-1]
    return [e.text for e in events if e.kind == "text"], events[-1].finish_reason


def cut_before_the_emoji(cut) -> None:
    byte_pipe, prompt, p, before = cut
    for extra in (1, 2, 3):  # cut after 1, 2 or 3 of the emoji's 4 bytes
        pieces, finish = scheduled(byte_pipe, prompt, p + extra)
        assert "".join(pieces) == before and finish == "length", (extra, pieces)
        assert not any(piece.endswith("\ufffd") for piece in pieces), pieces
    pieces, _ = scheduled(byte_pipe, prompt, p + 4)  # its last byte: the emoji is text
    assert "".join(pieces) == before + EMOJI


def test_a_reply_cut_inside_an_emoji_ends_before_it_in_the_scheduler(cut):
    cut_before_the_emoji(cut)


def test_a_scheduler_that_sends_half_an_emoji_is_caught(cut, monkeypatch):
    """The planted bug: the server's decode is the tokenizer's own (the unfinished bytes as U+FFFD)."""
    monkeypatch.setattr(
        Detokenizer, "__call__", lambda self, ids: self._decode([t for t in ids if t not in self.skipped])
    )
    with pytest.raises(AssertionError, match="\ufffd"):
        cut_before_the_emoji(cut)


def test_a_reply_cut_inside_an_emoji_ends_before_it_over_http(cut):
    byte_pipe, prompt, p, before = cut
    with ServerThread(make_app(byte_pipe)) as server:
        for max_tokens, text in ((p + 3, before), (p + 4, before + EMOJI)):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["text"] == text and reply["choices"][0]["finish_reason"] == "length"
            assert reply["usage"]["completion_tokens"] == max_tokens
            streamed = server.client().completions.create(**body, stream=True)
            pieces = [c.choices[0].text for c in streamed]
            assert "".join(pieces) == text and not any(piece.endswith("\ufffd") for piece in pieces), pieces
