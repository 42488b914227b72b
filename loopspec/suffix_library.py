"""A suffix index shared across requests: the outputs of finished requests, kept per scope.

A request's own `SuffixIndex` (loopspec/tree.py) proposes only what its prompt and its own output
repeat. A server answering the same task again and again (an agent's loop, a coding task re-asked
with small edits) produces outputs that repeat earlier outputs: `SuffixLibrary` keeps the last
`capacity` finished outputs and proposes, for a live request's text, the continuation of the
latest earlier output in which the text's suffix occurred (SuffixDecoding's global tree, beside
its per-request one).

What it keeps of a finished request: its output, led in by the prompt's last `max_match` tokens.
The lead-in lets a request that asks again be proposed the earlier answer from its first round
(its text then ends with the same prompt tail); the rest of the prompt is not kept — it is the
client's text, already in a repeating request's own index, and would fill the library with
documents rather than answers.

Scopes: every output is filed under its request's scope (an opaque hashable the server derives
from the API key and the `user` field); a lookup reads its own scope only, so text never crosses
scopes. The bound is on outputs in all (first in, first out across scopes), so the memory the
library holds does not grow with the number of scopes. What it may hold in all is bounded too
(`check_library_size`): about 1 KiB a token (loopspec/settings.py SHARED_SUFFIX_BYTES_PER_TOKEN), at
most SHARED_SUFFIX_MAX_TOKENS tokens (8 GiB) for outputs as long as a server lets a request ask for.

Proposals only choose what the target verifies: the output is the target's whatever is proposed.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Hashable

from loopspec.errors import LoopspecError
from loopspec.settings import SHARED_SUFFIX_BYTES_PER_TOKEN, SHARED_SUFFIX_MAX_TOKENS
from loopspec.tree import SUFFIX_MAX_MATCH, SUFFIX_MIN_MATCH


def check_library_size(outputs: int, max_tokens: int) -> None:
    """Refuse, in one line, a library of `outputs` outputs of up to `max_tokens` tokens each (led in by
    SUFFIX_MAX_MATCH prompt tokens) that could grow past SHARED_SUFFIX_MAX_TOKENS tokens."""
    tokens = outputs * (max_tokens + SUFFIX_MAX_MATCH)
    if tokens > SHARED_SUFFIX_MAX_TOKENS:
        most = SHARED_SUFFIX_MAX_TOKENS // (max_tokens + SUFFIX_MAX_MATCH)
        raise LoopspecError(
            f"--shared-suffix {outputs} would keep up to {tokens} tokens ({outputs} outputs of up to "
            f"{max_tokens} tokens, --max-tokens-limit, + a {SUFFIX_MAX_MATCH}-token lead-in), about "
            f"{tokens * SHARED_SUFFIX_BYTES_PER_TOKEN / 2**30:.4g} GiB; the library holds at most "
            f"{SHARED_SUFFIX_MAX_TOKENS} tokens (8 GiB): use --shared-suffix {most} or less, or a lower "
            "--max-tokens-limit"
        )


@dataclass
class _Scope:
    """One scope's outputs and, for every n-gram followed by a token in one of them, its latest end."""

    outputs: dict[int, list[int]] = field(default_factory=dict)  # output id → tokens (lead-in included)
    last_end: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # n-gram → (output id, end)


class SuffixLibrary:
    """The last `capacity` finished outputs, filed by scope (see the module's docstring)."""

    def __init__(self, capacity: int, min_match: int = SUFFIX_MIN_MATCH, max_match: int = SUFFIX_MAX_MATCH):
        if capacity < 1:
            raise ValueError(f"a suffix library keeps >= 1 output, got {capacity}")
        self.capacity, self.min_match, self.max_match = capacity, min_match, max_match
        self.scopes: dict[Hashable, _Scope] = {}
        self.order: collections.deque[tuple[Hashable, int]] = collections.deque()  # (scope, output id), oldest first
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.order)

    def add(self, scope: Hashable, prompt_ids: list[int], output: list[int]) -> None:
        """File a finished request's output (led in by its prompt's last max_match tokens) under
        `scope`; the oldest output (of any scope) goes when more than `capacity` are kept."""
        if not output:
            return
        tokens = list(prompt_ids[-self.max_match :]) + list(output)
        book = self.scopes.setdefault(scope, _Scope())
        oid = next(self._ids)
        book.outputs[oid] = tokens
        for end in range(len(tokens) - 1):  # an n-gram ending at the last token proposes nothing
            for n in range(self.min_match, min(self.max_match, end + 1) + 1):
                book.last_end[tuple(tokens[end - n + 1 : end + 1])] = (oid, end)
        self.order.append((scope, oid))
        while len(self.order) > self.capacity:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest output and the n-grams whose latest occurrence was in it (a later output
        holding the same n-gram had replaced its entry already, and every earlier one is gone)."""
        scope, oid = self.order.popleft()
        book = self.scopes[scope]
        tokens = book.outputs.pop(oid)
        for end in range(len(tokens) - 1):
            for n in range(self.min_match, min(self.max_match, end + 1) + 1):
                key = tuple(tokens[end - n + 1 : end + 1])
                if book.last_end.get(key, (None,))[0] == oid:
                    del book.last_end[key]
        if not book.outputs:
            del self.scopes[scope]

    def match(self, scope: Hashable, text: list[int]) -> tuple[int, int, int]:
        """The longest suffix of `text` (n tokens, min_match..max_match) that some output of `scope`
        holds followed by a token → (n, output id, end of its latest occurrence); (0, -1, -1) if none."""
        book = self.scopes.get(scope)
        if book is None:
            return 0, -1, -1
        for n in range(min(self.max_match, len(text)), self.min_match - 1, -1):
            hit = book.last_end.get(tuple(text[len(text) - n :]))
            if hit is not None:
                return n, hit[0], hit[1]
        return 0, -1, -1

    def continuation(self, scope: Hashable, oid: int, end: int, length: int) -> list[int]:
        """Up to `length` tokens that followed position `end` of output `oid` (fewer where it ends)."""
        return self.scopes[scope].outputs[oid][end + 1 : end + 1 + length]

    def view(self, scope: Hashable) -> "SharedSuffix":
        """What one request's own index consults: this library, read in `scope` only."""
        return SharedSuffix(self, scope)


@dataclass(frozen=True)
class SharedSuffix:
    """A library read in one scope: what a request's SuffixIndex holds beside its own text."""

    library: SuffixLibrary
    scope: Hashable

    def match(self, text: list[int]) -> tuple[int, int, int]:
        return self.library.match(self.scope, text)

    def continuation(self, oid: int, end: int, length: int) -> list[int]:
        return self.library.continuation(self.scope, oid, end, length)
