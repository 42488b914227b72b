"""Draft trees (DDTree-style, docs/concepts.md): what one target verification checks, and where its nodes come from.

A `DraftTree` lists its nodes in verification order; node 0 is the anchor (the root), and every
other node's parent comes before it. Two sources fill it:
- the drafter: one DFlash/DLoop round gives the top candidates at every depth; `best_first` keeps
  the `budget` paths of highest cumulative drafter log-prob (a node's first child is rank 0 at the
  next depth, its next sibling the next rank at the same depth). A DLoop stage after the first was
  drafted from the previous stage's argmax chain, so only that chain continues into it. Budget 0 is
  the argmax chain itself.
- the committed text: `SuffixIndex` proposes the continuation of the longest earlier occurrence of
  the text's suffix (what prompt lookup / n-gram drafting does elsewhere), or of earlier requests'
  outputs (loopspec/suffix_library.py) where those match longer; `DraftTree.add_branch` merges it
  in, reusing the nodes it shares with the drafter's.

The target verifies every node in one forward with an ancestor-only mask (`tree_masks`): a node
sees the committed context, its ancestors and itself, at position anchor + depth. Which node the
acceptance walk follows does not depend on where a node came from, so any source keeps the output
exact (loopspec.decoding.tree_accept).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

SUFFIX_MIN_MATCH, SUFFIX_MAX_MATCH = 2, 6  # the n-gram lengths a SuffixIndex matches


@dataclass
class DraftTree:
    tokens: list[int]  # node i's token; node 0 is the anchor
    parents: list[int]  # node i's parent (< i); -1 for the anchor
    depths: list[int]  # 0 for the anchor
    from_drafter: list[bool]
    from_suffix: list[bool]
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @classmethod
    def root(cls, anchor: int) -> "DraftTree":
        return cls([anchor], [-1], [0], [False], [False])

    @classmethod
    def chain(cls, anchor: int, drafts: list[int]) -> "DraftTree":
        tree = cls.root(anchor)
        node = 0
        for token in drafts:
            node = tree.add(node, token, from_drafter=True)
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def drafts(self) -> int:
        """Nodes besides the anchor."""
        return len(self.tokens) - 1

    def child(self, node: int, token: int) -> int | None:
        return self._children.get((node, token))

    def add(self, parent: int, token: int, *, from_drafter: bool = False, from_suffix: bool = False) -> int:
        """The child of `parent` with `token` (a new node unless it exists; sources are merged) → its index."""
        existing = self._children.get((parent, token))
        if existing is not None:
            self.from_drafter[existing] |= from_drafter
            self.from_suffix[existing] |= from_suffix
            return existing
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.from_drafter.append(from_drafter)
        self.from_suffix.append(from_suffix)
        self._children[(parent, token)] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def add_branch(self, tokens: list[int], max_new_nodes: int) -> None:
        """Merge a suffix-index continuation from the root: shared nodes are reused, at most
        `max_new_nodes` are added (the branch stops at the first one that does not fit)."""
        node = 0
        for token in tokens:
            if self.child(node, token) is None:
                if max_new_nodes <= 0:
                    return
                max_new_nodes -= 1
            node = self.add(node, token, from_suffix=True)

    def subtree(self, nodes: list[int]) -> "DraftTree":
        """The tree of the anchor and `nodes` (ascending, each one's parent among them), in that order."""
        tree = DraftTree.root(self.tokens[0])
        new = {0: 0}
        for node in nodes:
            new[node] = tree.add(new[self.parents[node]], self.tokens[node], from_drafter=self.from_drafter[node],
                                 from_suffix=self.from_suffix[node])
        return tree

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path(self, node: int) -> list[int]:
        """Nodes from the root to `node`, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[T, T] bool: node i sees node j iff j is i or one of its ancestors."""
        T = len(self.tokens)
        mask = torch.eye(T, dtype=torch.bool)
        for i in range(1, T):
            mask[i] |= mask[self.parents[i]]
        return mask


def best_first(anchor: int, candidates: torch.Tensor, logprobs: torch.Tensor, budget: int,
               stage_sizes: list[int] | None = None) -> DraftTree:
    """The `budget` best nodes over per-depth candidates → a DraftTree.

    candidates/logprobs [D, C]: depth d+1's candidates, rank-ordered, with the drafter's log-probs.
    A node's score is the sum of its path's log-probs, and nodes are taken best first; since a child
    never scores above its parent nor a sibling above its elder, every node's parent is already
    taken. `stage_sizes` (DLoop: the depths each stage drafted, in order) — a later stage was drafted
    after the previous stage's argmax chain, so only that chain's last node has children in it."""
    tree = DraftTree.root(anchor)
    D, C = candidates.shape
    if D == 0 or budget <= 0:
        return tree
    stage_of = [s for s, n in enumerate(stage_sizes or [D]) for _ in range(n)] + [-1] * D  # [>= D]
    ids, lp = candidates.tolist(), logprobs.float().tolist()
    # heap entries: (-score, tie, depth index, rank, parent node, parent on the argmax chain)
    heap = [(-lp[0][0], 0, 0, 0, 0, True)]
    tie = 1
    while heap and tree.drafts < budget:
        neg, _, d, r, parent, parent_on_chain = heapq.heappop(heap)
        node = tree.add(parent, ids[d][r], from_drafter=True)
        on_chain = parent_on_chain and r == 0
        if d + 1 < D and (on_chain or stage_of[d + 1] == stage_of[d]):
            heapq.heappush(heap, (neg - lp[d + 1][0], tie, d + 1, 0, node, on_chain))
            tie += 1
        if r + 1 < C:
            heapq.heappush(heap, (neg + lp[d][r] - lp[d][r + 1], tie, d, r + 1, parent, parent_on_chain))
            tie += 1
    return tree


def draft_tree(anchor: int, candidates: torch.Tensor, logprobs: torch.Tensor, stage_sizes: list[int], *,
               tree_budget: int, suffix: list[int], max_nodes: int) -> DraftTree:
    """The tree one verification checks: the drafter's nodes (tree_budget 0: its argmax chain over
    every drafted depth; else the best `tree_budget` nodes), then the suffix continuation merged in;
    at most `max_nodes` nodes besides the anchor (what the context still holds)."""
    if tree_budget == 0:
        tree = DraftTree.chain(anchor, candidates[:max_nodes, 0].tolist())
    else:
        tree = best_first(anchor, candidates, logprobs, min(tree_budget, max_nodes), stage_sizes)
    if suffix:
        tree.add_branch(suffix, max_nodes - tree.drafts)
    return tree


def tree_masks(trees: list[DraftTree], width: int) -> torch.Tensor:
    """The rows' ancestor masks right-padded to `width` → bool [B, width, width]; a padding token
    sees only itself (never seen by a real one)."""
    mask = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, tree in enumerate(trees):
        mask[b, :len(tree), :len(tree)] = tree.ancestor_mask()
    return mask


class SuffixIndex:
    """The committed tokens of one request (prompt + output) and, for every n-gram of `min_match` ..
    `max_match` tokens, where it last ended — kept incrementally, O(max_match) per token.

    `continuation(n)` finds the longest suffix of the text that occurred before (ending before the
    last token), and proposes the n tokens that followed its latest occurrence; where those run
    into the suffix itself (a repeating loop), the loop's period continues them.

    `shared` (a loopspec.suffix_library.SharedSuffix: earlier requests' outputs, read in this
    request's scope): where the text's suffix matched there for MORE tokens than in the text itself,
    the continuation is that output's instead; a tie goes to the request's own text. The match
    length is the evidence that the continuation holds (a longer context agreed), and on equal
    evidence the request's own text, what it is writing now, is the better guess."""

    def __init__(self, tokens: list[int] = (), min_match: int = SUFFIX_MIN_MATCH, max_match: int = SUFFIX_MAX_MATCH,
                 shared=None):
        self.min_match, self.max_match = min_match, max_match
        self.shared = shared
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            t = len(self.tokens) - 1  # the n-grams ending here become "earlier" once a token follows
            for n in range(self.min_match, min(self.max_match, t + 1) + 1):
                self.last_end[tuple(self.tokens[t - n + 1:t + 1])] = t
            self.tokens.append(token)

    def longest_match(self) -> tuple[int, int]:
        """(n, end): the longest suffix of the text (n tokens, min_match..max_match) that occurred
        before, and where its latest earlier occurrence ends → (0, -1) when none did."""
        t = len(self.tokens) - 1
        for n in range(min(self.max_match, t + 1), self.min_match - 1, -1):
            end = self.last_end.get(tuple(self.tokens[t - n + 1:t + 1]))
            if end is not None:
                return n, end
        return 0, -1

    def _shared_match(self, own: int) -> tuple[int, int, int] | None:
        """The shared library's match when it is longer than the text's own `own` tokens, else None."""
        if self.shared is None:
            return None
        hit = self.shared.match(self.tokens[-self.max_match:])
        return hit if hit[0] > own else None

    def match_length(self) -> int:
        """The tokens of the suffix match that `continuation` follows (0: nothing matched)."""
        own = self.longest_match()[0]
        shared = self._shared_match(own)
        return shared[0] if shared else own

    def continuation(self, length: int) -> list[int]:
        n, end = self.longest_match()
        if length <= 0:
            return []
        shared = self._shared_match(n)
        if shared:
            return self.shared.continuation(shared[1], shared[2], length)
        if not n:
            return []
        period = len(self.tokens) - 1 - end  # tokens beyond the text repeat the loop end+1 .. t
        return [self.tokens[end + 1 + i % period] for i in range(length)]
