"""Draft trees (DDTree-style, docs/concepts.md): what one target verification checks, and where its nodes come from.

A `DraftTree` lists its nodes in verification order; node 0 is the anchor (the root), and every
other node's parent comes before it. Two sources fill it:
- the drafter: one DFlash/DLoop round gives the top candidates at every depth; `best_first` keeps
  the `budget` paths of highest cumulative drafter log-prob (a node's first child is rank 0 at the
  next depth, its next sibling the next rank at the same depth). A DLoop stage after the first was
  drafted from the previous stage's argmax chain, so only that chain continues into it. Budget 0 is
  the argmax chain itself. A DFlash2 drafter's stage gives its selector's whole `Lattice`, and
  `lattice_best_first` keeps its best paths, each child scored after its own parent. An EAGLE-3
  drafter may grow EAGLE-2's `DynamicTree` instead (tree kind "dynamic"): each step expands the
  top-K nodes of the newest depth, each drafted under its own path, and `DynamicTree.best` keeps
  the best `budget` of all it drafted.
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
            new[node] = tree.add(
                new[self.parents[node]],
                self.tokens[node],
                from_drafter=self.from_drafter[node],
                from_suffix=self.from_suffix[node],
            )
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


def best_first(
    anchor: int, candidates: torch.Tensor, logprobs: torch.Tensor, budget: int, stage_sizes: list[int] | None = None
) -> DraftTree:
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


class DynamicTree:
    """EAGLE-2's dynamic tree of one row as a chain drafter grows it (EAGLE-3's own tree).

    Node 0 is the anchor. At each drafter step the `frontier` — the top-K nodes of the newest depth
    by cumulative draft log-prob — is expanded: the drafter runs once per frontier node, conditioned
    on that node's own path (tree attention over its ancestors' steps), and each gets its top-K
    children. After the last step `best` reranks every drafted node by cumulative log-prob and keeps
    the best `budget`, one connected tree (a child never scores above its parent, and a tie goes to
    the shallower node, so every kept node's parent is kept)."""

    def __init__(self, anchor: int):
        self.tokens, self.parents, self.depths = [anchor], [-1], [0]
        self.scores = [0.0]  # the cumulative log-prob of each node's path
        self.logprobs = [0.0]  # each node's own log-prob given its path

    def __len__(self) -> int:
        return len(self.tokens)

    def add_children(self, node: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Children of `node` (its drafter step's top candidates) → their indices."""
        out = []
        for token, lp in zip(tokens, logprobs):
            self.tokens.append(token)
            self.parents.append(node)
            self.depths.append(self.depths[node] + 1)
            self.logprobs.append(lp)
            self.scores.append(self.scores[node] + lp)
            out.append(len(self.tokens) - 1)
        return out

    def _ranked(self, nodes) -> list[int]:
        return sorted(nodes, key=lambda n: (-self.scores[n], self.depths[n], n))

    def frontier(self, depth: int, top_k: int) -> list[int]:
        """The `top_k` nodes at `depth` of highest cumulative log-prob (ties: the earlier node)."""
        return self._ranked(n for n in range(len(self)) if self.depths[n] == depth)[:top_k]

    def ancestors(self, node: int) -> list[int]:
        """The nodes between the anchor and `node`, both left out, root side first."""
        out = []
        node = self.parents[node]
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def best(self, budget: int) -> DraftTree:
        """The `budget` drafted nodes of highest cumulative log-prob as a DraftTree (best first)."""
        tree, new = DraftTree.root(self.tokens[0]), {0: 0}
        for node in self._ranked(range(1, len(self))):
            if tree.drafts >= budget:
                break
            if self.parents[node] in new:  # always, but for log-probs rounded above 0
                new[node] = tree.add(new[self.parents[node]], self.tokens[node], from_drafter=True)
        return tree

    def ranked_candidates(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per depth, `width` nodes as a chain drafter's candidates [D, C] and their own log-probs:
        rank 0 the path to the best node of the deepest depth (a chain through the tree), the other
        ranks the depth's next best nodes (padded with rank 0)."""
        D = max(self.depths)
        deepest = self._ranked(n for n in range(len(self)) if self.depths[n] == D)[0]
        chain = self.ancestors(deepest) + [deepest]
        ids, lps = [], []
        for d in range(1, D + 1):
            nodes = [chain[d - 1]] + [
                n for n in self._ranked(n for n in range(len(self)) if self.depths[n] == d) if n != chain[d - 1]
            ][: width - 1]
            nodes += [nodes[0]] * (width - len(nodes))
            ids.append([self.tokens[n] for n in nodes])
            lps.append([self.logprobs[n] for n in nodes])
        return torch.tensor(ids, dtype=torch.long), torch.tensor(lps)


@dataclass
class Lattice:
    """A DFlash2 candidate selector's lattice over one row's drafted depths: candidates [D, K] (each
    slot's top-K tokens of the target head) and logprobs [D, K, K], where logprobs[i, a, b] is the
    log-prob of candidate b at slot i after candidate a at slot i-1 — log-softmax over the slot's
    candidates of unary[b] + edge(a → b), the walk's own score. A stage's first slot follows its anchor
    alone: row 0 holds the anchor's, and the other rows are -inf (no edge). Where a DLoop stage follows
    another, its first slot's row is the previous slot's walk candidate only: that stage was drafted
    after the walk, so only the walk continues into it."""

    candidates: torch.Tensor  # [D, K] ([R, D, K] for a stage's rows)
    logprobs: torch.Tensor  # [D, K, K] ([R, D, K, K])

    def row(self, r: int) -> "Lattice":
        """Row r's lattice of a stage's rows."""
        return Lattice(self.candidates[r], self.logprobs[r])

    @classmethod
    def join(cls, stages: list["Lattice"], walk: list[int], depth: int) -> "Lattice":
        """One row's stages (in order) as one lattice of at most `depth` slots; `walk` the walk's token at
        every slot (the chain the later stages were drafted after)."""
        candidates, logprobs = [stages[0].candidates], [stages[0].logprobs]
        for stage in stages[1:]:
            slot = sum(c.shape[0] for c in candidates) - 1  # the previous stage's last slot
            first = torch.full_like(stage.logprobs[0], float("-inf"))  # [K, K]
            on_walk = (candidates[-1][-1] == walk[slot]).nonzero()
            first[int(on_walk[0, 0])] = stage.logprobs[0, 0]
            candidates.append(stage.candidates)
            logprobs.append(torch.cat([first[None], stage.logprobs[1:]]))
        return cls(torch.cat(candidates)[:depth], torch.cat(logprobs)[:depth])


def lattice_best_first(anchor: int, lattice: Lattice, budget: int) -> DraftTree:
    """The `budget` best paths of a selector's lattice → a DraftTree, best first by cumulative
    log-prob: a node's children are scored by the transition from the node's own candidate
    (lattice.logprobs[slot, its index]), each child taken before its next sibling (stable: ties go
    to the higher-ranked candidate, as the walk's do), so the tree's best path is the walk."""
    tree = DraftTree.root(anchor)
    D, K = lattice.candidates.shape
    if D == 0 or budget <= 0:
        return tree
    ids, lp = lattice.candidates.tolist(), lattice.logprobs.double()
    orders: dict[tuple[int, int], tuple[list[int], list[float]]] = {}

    def children(slot: int, parent_index: int) -> tuple[list[int], list[float]]:
        key = (slot, parent_index)
        if key not in orders:
            row = lp[slot, parent_index]
            order, values = row.sort(descending=True, stable=True).indices.tolist(), row.tolist()
            orders[key] = ([b for b in order if values[b] > float("-inf")], values)
        return orders[key]

    # heap entries: (-score, tie, slot, rank among the parent's children, parent node, parent's index)
    heap, tie = [], 0
    order, row = children(0, 0)
    if order:
        heap.append((-row[order[0]], tie, 0, 0, 0, 0))
    while heap and tree.drafts < budget:
        neg, _, slot, rank, parent, parent_index = heapq.heappop(heap)
        order, row = children(slot, parent_index)
        index = order[rank]
        node = tree.add(parent, ids[slot][index], from_drafter=True)
        if rank + 1 < len(order):
            tie += 1
            heapq.heappush(heap, (neg + row[index] - row[order[rank + 1]], tie, slot, rank + 1, parent, parent_index))
        if slot + 1 < D:
            below, below_row = children(slot + 1, index)
            if below:
                tie += 1
                heapq.heappush(heap, (neg - below_row[below[0]], tie, slot + 1, 0, node, index))
    return tree


def draft_tree(
    anchor: int,
    candidates: torch.Tensor,
    logprobs: torch.Tensor,
    stage_sizes: list[int],
    *,
    tree_budget: int,
    suffix: list[int],
    max_nodes: int,
    dynamic: DynamicTree | None = None,
    lattice: Lattice | None = None,
) -> DraftTree:
    """The tree one verification checks: the drafter's nodes (tree_budget 0: its argmax chain over
    every drafted depth; else the best `tree_budget` nodes: of an EAGLE-2 dynamic tree where the
    drafter grew one, of a DFlash2 selector's lattice where it has one, else best first over each
    depth's candidates), then the suffix continuation merged in; at most `max_nodes` nodes besides
    the anchor (what the context still holds)."""
    if tree_budget == 0:
        tree = DraftTree.chain(anchor, candidates[:max_nodes, 0].tolist())
    elif dynamic is not None:
        tree = dynamic.best(min(tree_budget, max_nodes))
    elif lattice is not None:
        tree = lattice_best_first(anchor, lattice, min(tree_budget, max_nodes))
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
        mask[b, : len(tree), : len(tree)] = tree.ancestor_mask()
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

    def __init__(
        self, tokens: list[int] = (), min_match: int = SUFFIX_MIN_MATCH, max_match: int = SUFFIX_MAX_MATCH, shared=None
    ):
        self.min_match, self.max_match = min_match, max_match
        self.shared = shared
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            t = len(self.tokens) - 1  # the n-grams ending here become "earlier" once a token follows
            for n in range(self.min_match, min(self.max_match, t + 1) + 1):
                self.last_end[tuple(self.tokens[t - n + 1 : t + 1])] = t
            self.tokens.append(token)

    def longest_match(self) -> tuple[int, int]:
        """(n, end): the longest suffix of the text (n tokens, min_match..max_match) that occurred
        before, and where its latest earlier occurrence ends → (0, -1) when none did."""
        t = len(self.tokens) - 1
        for n in range(min(self.max_match, t + 1), self.min_match - 1, -1):
            end = self.last_end.get(tuple(self.tokens[t - n + 1 : t + 1]))
            if end is not None:
                return n, end
        return 0, -1

    def _shared_match(self, own: int) -> tuple[int, int, int] | None:
        """The shared library's match when it is longer than the text's own `own` tokens, else None."""
        if self.shared is None:
            return None
        hit = self.shared.match(self.tokens[-self.max_match :])
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
