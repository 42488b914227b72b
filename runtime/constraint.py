"""Structured output: a grammar that constrains every token a row commits, drafts included.

A `GrammarSpec` is what a user asks for (a JSON schema, any JSON object, a regular expression, one
of given strings), checked without a model; `Grammars` compiles specs for one tokenizer (built once
per pipeline); a `Constraint` is one row's grammar state, a matcher of the `xgrammar` library
(imported lazily: loopspec imports without it; chosen over llguidance for its cheaper per-token
mask, docs/runs/2026-12-06/grammar-mask-cost.json), which the decoder (runtime/decoder.py) asks three
things of:

- `prune(tree)`: the draft tree without the nodes the grammar rejects after their parent's path
  (and without their descendants), walked depth first with the matcher advanced and rolled back;
  the masks of the nodes kept are computed on the same walk;
- `masks(tree)`: the allowed tokens after each node's path, bool [nodes, vocab]: the target's logits
  are masked (-inf) with them before acceptance, so each committed token is drawn from the target's
  constrained distribution exactly as plain decoding with the same masks draws it (`allowed()`
  masks the first token after prefill);
- `commit(token)`: advance over a committed token → whether the grammar is complete (the row stops).

A row's stop tokens are allowed only where the grammar accepts; after a stop token nothing is
constrained (the row ends there).

A model that reasons before it answers (Qwen3's `<think>` block) gets the grammar after its
reasoning (`after_reasoning(end token)`): until the end token is committed every token but a stop
token is allowed, then the grammar starts; a draft that carries the end token is pruned and masked
with the free mask before it and the grammar's after it, so the boundary may fall inside a verified
draft.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from loopspec.errors import LoopspecError
from loopspec.tree import DraftTree
from loopspec.runtime.schema_check import pattern_refusal, schema_refusal

KINDS = ("json_object", "json_schema", "regex", "choice", "structural_tag")


class GrammarError(LoopspecError):
    """A grammar that cannot be used, naming where it came from (`param`: a request field or a flag)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param, self.reason = param, message


class GrammarBusy(GrammarError):
    """A grammar not compiled within the caller's time, or too many compiling: the server answers 429 (the
    compile goes on, and its result is kept for the same grammar's next request)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise LoopspecError("structured output needs xgrammar: pip install 'loopspec[grammar]'") from None
    return xgrammar


def _one_line(error: Exception) -> str:
    """xgrammar's message without its timestamp and source location."""
    text = " ".join(str(error).split())
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)[:300]


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. kind: json_object (value None) | json_schema (a schema dict) |
    regex (a pattern) | choice (a tuple of strings) | structural_tag (xgrammar's structural tag, a dict:
    how runtime/tool_calls.py forces a template's call around a function's schema); param: the
    request field or flag it came from.
    A spec that cannot be compiled is refused on construction (GrammarError naming `param`)."""

    kind: str
    value: object = None
    param: str = "grammar"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (choose from {', '.join(KINDS)})", self.param)
        if self.kind == "json_schema" and not isinstance(self.value, dict):
            raise GrammarError("a JSON schema must be a JSON object", self.param)
        if self.kind == "structural_tag" and not isinstance(self.value, dict):
            raise GrammarError("a structural tag must be a JSON object", self.param)
        if self.kind == "regex" and not (isinstance(self.value, str) and self.value):
            raise GrammarError("a regular expression must be a non-empty string", self.param)
        if self.kind == "choice":
            if not (
                isinstance(self.value, (list, tuple))
                and self.value
                and all(isinstance(c, str) and c for c in self.value)
            ):
                raise GrammarError("choices must be a non-empty list of non-empty strings", self.param)
            object.__setattr__(self, "value", tuple(self.value))
        why = (
            schema_refusal(self.value)
            if self.kind == "json_schema"
            else pattern_refusal(self.value, "the regular expression")
            if self.kind == "regex"
            else None
        )
        if why is not None:  # what xgrammar would not enforce, or could not convert in bounded time
            raise GrammarError(why, self.param)
        object.__setattr__(self, "converted", self.grammar())  # compiled later from this (Grammars)

    def key(self) -> tuple[str, str]:
        """What a compiled grammar is kept under (Grammars): the kind and the value's JSON, keys in order."""
        return self.kind, json.dumps(self.value, ensure_ascii=False, separators=(",", ":"))

    def grammar(self):
        """The spec as an xgrammar Grammar (JSON: the separators ", " and ": ", no other whitespace)."""
        grammar = _xgrammar().Grammar
        try:
            if self.kind in ("json_object", "json_schema"):
                schema = self.value if self.kind == "json_schema" else {"type": "object"}
                return grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
            if self.kind == "regex":
                return grammar.from_regex(self.value)
            if self.kind == "structural_tag":
                return grammar.from_structural_tag(json.dumps(self.value))
            return grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.value))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_one_line(e), self.param) from None

    def describe(self) -> str:
        return {
            "json_object": "any JSON object",
            "json_schema": "a JSON schema",
            "regex": f"regex {self.value!r}",
            "choice": f"one of {len(self.value or ())} choices",
            "structural_tag": "a structural tag",
        }[self.kind]


def json_schema_ebnf(schema: dict, param: str) -> str:
    """`schema` as the EBNF text of the grammar the json_schema kind compiles (the same separators), for
    grammars that embed a schema (a structural tag's "grammar" content: runtime/tool_calls.py)."""
    return str(GrammarSpec("json_schema", schema, param).grammar())


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's table), inverted."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars)}


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes each token id of a fast (tokenizers-backed) tokenizer stands for: byte-level BPE's
    stand-in characters mapped back to bytes, SentencePiece's byte tokens (<0xNN>) and word marks
    (▁), else the token's own text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise LoopspecError("structured output needs a fast (tokenizers-backed) tokenizer")
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    table = _byte_of_char()
    out = []
    for piece in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        if piece is None:
            out.append(b"")
        elif "ByteLevel" in kinds and all(c in table for c in piece):
            out.append(bytes(table[c] for c in piece))
        elif "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode("utf-8"))
    return out


COMPILE_THREADS = 1  # grammars compiled at once (the server decodes on another core)
MAX_PENDING_COMPILES = 4  # compiling or waiting to; one more uncached grammar is refused (GrammarBusy)
GRAMMAR_CACHE = 64  # compiled grammars kept, the least recently used dropped first


class Grammars:
    """Compiles GrammarSpecs into row Constraints for one tokenizer and target vocabulary (ids the
    tokenizer does not have, and its special tokens, are never allowed; stop tokens only where the
    grammar may end)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        if len(tokenizer) > vocab_size:
            raise LoopspecError(f"the tokenizer has {len(tokenizer)} tokens, more than the target's {vocab_size}")
        xgrammar = _xgrammar()
        vocab = token_bytes(tokenizer)
        for special in getattr(tokenizer, "all_special_ids", []):
            vocab[special] = b""  # never text
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgrammar.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        self.compiler, self.vocab_size = xgrammar.GrammarCompiler(info, max_threads=1), vocab_size
        self.compiles = 0  # grammars compiled (a grammar found in the cache is not compiled again)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # by GrammarSpec.key(), oldest first
        self._lock, self._slots, self._pending = threading.Lock(), threading.Semaphore(COMPILE_THREADS), 0

    def compiling(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of `spec` as a future: the cached one, else compiled on a worker thread
        (xgrammar releases the GIL while it compiles, so the caller's thread, the server's event loop,
        goes on). GrammarBusy when MAX_PENDING_COMPILES are compiling or waiting to."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pending >= MAX_PENDING_COMPILES:
                raise GrammarBusy(
                    f"{self._pending} grammars are compiling or waiting to, the most this server takes on; "
                    "send the request again later",
                    spec.param,
                )
            future = self._cache[key] = Future()
            self._pending += 1
            for old in [k for k, f in self._cache.items() if f.done()][: max(len(self._cache) - GRAMMAR_CACHE, 0)]:
                del self._cache[old]  # the least recently used compiled grammars go first
        threading.Thread(target=self._compile, args=(spec, key, future), name="loopspec-grammar", daemon=True).start()
        return future

    def _compile(self, spec: GrammarSpec, key: tuple[str, str], future: Future) -> None:
        with self._slots:
            with self._lock:
                self.compiles += 1
            try:
                future.set_result(self.compiler.compile_grammar(spec.converted))
            except RuntimeError as e:  # kept: the same grammar fails the same way
                future.set_exception(GrammarError(_one_line(e), spec.param))
            except BaseException as e:  # not kept (memory, an interrupt): the next request tries again
                with self._lock:
                    self._cache.pop(key, None)
                future.set_exception(e)
            finally:
                with self._lock:
                    self._pending -= 1

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A new row's grammar state for `spec`, waiting for its compile."""
        return self._constraint(spec, self.compiling(spec))

    async def constraint_within(self, spec: GrammarSpec, timeout_s: float) -> "Constraint":
        """`constraint` for an event loop: the compile is awaited, off the loop, at most `timeout_s`
        (then GrammarBusy; the compile goes on and is kept)."""
        future = self.compiling(spec)
        waiting = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({waiting}, timeout=timeout_s)
        if not done:
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody reads it: no warning
            raise GrammarBusy(
                f"its grammar is still compiling after {timeout_s:g} s; the compile goes on and is kept: "
                "send the request again later",
                spec.param,
            )
        return self._constraint(spec, future)

    def _constraint(self, spec: GrammarSpec, future: Future) -> "Constraint":
        xgrammar = _xgrammar()
        try:
            compiled = future.result()
        except GrammarError as e:  # compiled for another request: this one's field
            raise GrammarError(e.reason, spec.param) from None
        constraint = Constraint(
            xgrammar.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids),
            self.vocab_size,
            frozenset(self.stop_token_ids),
        )
        if not bool(constraint.allowed().any()):  # nothing to sample: refused, not a 500 at the first token
            raise GrammarError("no token of this model's vocabulary can begin it", spec.param)
        return constraint


class Constraint:
    """One row's grammar: its matcher sits after the row's committed tokens (see the module doc)."""

    def __init__(self, matcher, vocab_size: int, stop_token_ids: frozenset[int]):
        self.matcher, self.vocab_size, self.stop = matcher, vocab_size, frozenset(stop_token_ids)
        self.stop_ids = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
        self.bitmask = _xgrammar().allocate_token_bitmask(1, vocab_size)  # current_mask fills it in place
        self._now: torch.Tensor | None = None  # allowed() after the committed tokens, once computed
        self._pruned: tuple[DraftTree, torch.Tensor] | None = None  # the last pruned tree and its masks
        # the token that ends the row's reasoning (Qwen3's `</think>`) while the grammar waits for it
        self.reasoning_end: int | None = None
        self._free = torch.ones(vocab_size, dtype=torch.bool)  # what a row may write while it reasons
        self._free[self.stop_ids] = False  # not end: the grammar's text is still to come

    def after_reasoning(self, end_token: int) -> None:
        """The grammar starts where the row's reasoning ends: until `end_token` is committed every
        token but a stop token is allowed, and the grammar constrains what follows it, also when the
        boundary falls inside a verified draft (`prune` switches at the node that carries it)."""
        if end_token in self.stop:
            raise LoopspecError(f"token {end_token} ends generation, not reasoning")
        self.reasoning_end, self._now = end_token, None

    def current_mask(self) -> torch.Tensor:
        """bool [vocab] at the matcher's state (xgrammar's bitmask: stop tokens only where it may end),
        computed anew on every call (`allowed` keeps the one after the committed tokens). Public for
        scripts/grammar_mask_cost.py, which times it beside xgrammar's own fill of `bitmask`."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows after the committed tokens."""
        if self._now is None:
            self._now = self._free if self.reasoning_end is not None else self.current_mask()
        return self._now

    def commit(self, token: int) -> bool:
        """Advance over a committed (non-stop) token → whether the grammar is now complete (nothing
        but a stop token may follow)."""
        if self.reasoning_end is not None:  # still reasoning: the end token starts the grammar
            if token == self.reasoning_end:
                self.reasoning_end, self._now = None, self.current_mask()
            return False
        if not self.matcher.accept_token(token):
            raise LoopspecError(f"token {token} breaks the grammar")
        self._now = self.current_mask()
        return self._complete(self._now)

    def _complete(self, mask: torch.Tensor) -> bool:
        others = mask.clone()
        others[self.stop_ids] = False
        return not bool(others.any())

    def prune(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes the grammar rejects after their parent's path (and their
        descendants); a stop token's children go too (nothing follows it). The kept nodes' masks are
        kept for `masks`."""
        children: dict[int, list[int]] = {}
        for node in range(1, len(tree)):
            children.setdefault(tree.parents[node], []).append(node)
        kept, masks = {0: 0}, {0: self.allowed()}
        pruned = DraftTree.root(tree.tokens[0])

        def visit(node: int, reasoning: bool) -> None:  # the matcher sits after `node`'s path
            for child in children.get(node, []):
                token = tree.tokens[child]
                if not masks[node][token]:
                    continue
                kept[child] = pruned.add(
                    kept[node], token, from_drafter=tree.from_drafter[child], from_suffix=tree.from_suffix[child]
                )
                if token in self.stop:  # the row ends there: whatever it would sample next is dropped
                    masks[child] = torch.ones(self.vocab_size, dtype=torch.bool)
                    continue
                if reasoning:  # the matcher has not started: the end token starts it, below this node
                    ends = token == self.reasoning_end
                    masks[child] = self.current_mask() if ends else self._free
                    visit(child, not ends)
                    continue
                self.matcher.accept_token(token)
                masks[child] = self.current_mask()
                visit(child, False)
                self.matcher.rollback(1)

        visit(0, self.reasoning_end is not None)
        order = sorted(kept, key=kept.get)  # the old nodes in the pruned tree's order
        self._pruned = (pruned, torch.stack([masks[n] for n in order]))
        return pruned

    def masks(self, tree: DraftTree) -> torch.Tensor:
        """bool [len(tree), vocab]: the tokens allowed after each node's path (`tree` as `prune` gave it)."""
        if self._pruned is None or self._pruned[0] is not tree:
            raise LoopspecError("masks of a tree that prune did not give")
        return self._pruned[1]


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`logits` [..., V] with the tokens not `allowed` at -inf."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
