"""An EAGLE-3 drafter's context on the torch engine (loopspec/model/eagle3.py): its `DrafterContext`
(engines/protocol.py), per row.

An EAGLE-3 context entry pairs the target's fused taps at position p with the token at p+1, and its
K/V need both. So a row keeps three things, each with its own length:
- `states` [rows, max, H]: the fused taps of every position the decoder appended (`lengths`);
- `tokens` [rows, max]: the tokens at every position the target holds, as prefill and verify wrote
  them and the commit moved them (the target's KV cache's own layout, so trees need nothing more);
- `kv` (a one-layer KVCache): the K/V of the entries already run. An entry is run when its next
  token is known: at the next stage, whose anchor is the token after the last appended position.

A stage (`draft`) first runs a row's pending entries (the last one, (anchor, taps at a-1), is the
stage's first step and drafts the token at a+1) and keeps their K/V; its later steps (draft i-1 and
the state step i-1 returned, at a+i-2) attend to those and to each other and are dropped after it.
Rolling a row back to length n drops its entries from n-1 on: the token after n-1 is the next
stage's anchor, not yet known.

A dynamic tree (`draft_dynamic`, EAGLE-2's) runs step 1 as a stage does, then one step per depth
over the top-K nodes of the newest depth at once, each node attending to the row's entries and to
its own ancestors' entries only; those steps' K/V are dropped after the tree, as a stage's are.

DLoop: a later stage appends the stage's own states (`append`: the state that drafted p+1 at p)
and starts from its last draft; its pending entries pair those states with the stage's drafts,
which the stage left in `tokens` past the anchor (slots the next verification overwrites), so it
runs on exactly as one longer stage would.
"""

from __future__ import annotations

import copy

import torch

from loopspec.decoding import DraftSampler
from loopspec.errors import LoopspecError
from loopspec.model.draft_head import StageDrafts, draft_candidates
from loopspec.model.eagle3 import Eagle3Drafter
from loopspec.model.kv_cache import KVCache
from loopspec.model.target import Target
from loopspec.tree import DynamicTree


class Eagle3Context:
    grows_dynamic_trees = True  # one drafter step a node: each node's step runs under its own path

    def __init__(self, drafter: Eagle3Drafter, target: Target, max_length: int, rows: int):
        p = drafter.norm.weight
        self.drafter, self.max_length = drafter, max_length
        # the drafter's own embedding where its checkpoint carries one, else the target's
        self.embed = drafter.embed_tokens if drafter.embed_tokens is not None else target.embed_tokens
        self.draft_ids = drafter.draft_ids.to(p.device) if drafter.draft_ids is not None else None
        self.cfg, self.dtype, self.device = drafter.cfg, p.dtype, p.device
        self._new_rows(rows)

    def _new_rows(self, rows: int) -> None:
        self.states = torch.zeros(rows, self.max_length, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.tokens = torch.zeros(rows, self.max_length + 1, dtype=torch.long)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.kv = self._new_kv(rows)

    def _new_kv(self, rows: int) -> KVCache:
        """The one layer's K/V of the entries already run."""
        return KVCache(
            1, rows, self.cfg.num_kv_heads, self.max_length, self.cfg.head_dim, dtype=self.dtype, device=self.device
        )

    def with_rows(self, max_rows: int) -> "Eagle3Context":
        twin = copy.copy(self)  # the same drafter
        twin._new_rows(max_rows)
        return twin

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's taps [R, T, 3·H_target] → the fused states [R, T, H]."""
        return self.drafter.fuse(taps)

    # ---- the target's tokens ---------------------------------------------------------------------
    def target_wrote(self, rows: list[int], starts: list[int], tokens: list[list[int]]) -> None:
        """The target stored tokens[i] at slots starts[i].. of rows[i] (a prefill, or a verification's)."""
        for row, start, t in zip(rows, starts, tokens):
            self.tokens[row, start : start + len(t)] = torch.tensor(t, dtype=torch.long)

    def target_committed(self, starts: list[int], kept: list[list[int]]) -> None:
        """As the target's cache commits: offsets kept[b] of the tokens from starts[b] move into place."""
        for b, (start, offsets) in enumerate(zip(starts, kept)):
            if offsets != list(range(len(offsets))):
                self.tokens[b, start : start + len(offsets)] = self.tokens[b, torch.tensor(offsets) + start]

    # ---- the context -----------------------------------------------------------------------------
    def append(self, rows: list[int], states: torch.Tensor, counts: list[int]) -> None:
        """`rows` append the first counts[i] fused states [R, T, H] at their lengths."""
        for i, (row, n) in enumerate(zip(rows, counts)):
            start = int(self.lengths[row])
            if start + n > self.max_length:
                raise LoopspecError(f"sequence of {start + n} exceeds the context of {self.max_length}")
            self.states[row, start : start + n] = states[i, :n].to(self.states.dtype)
            self.lengths[row] = start + n

    def append_taps(self, rows: list[int], taps: torch.Tensor, counts: list[int]) -> None:
        self.append(rows, self.fuse(taps), counts)

    def append_pseudo(self, rows: list[int], hidden: torch.Tensor) -> None:
        """DLoop: the drafter's own states, as its later steps take them (no fc)."""
        self.append(rows, hidden, [hidden.shape[1]] * len(rows))

    def restart(self, row: int, start: int) -> None:
        """`row` starts over at `start` (a prefill: 0, or the prompt positions its earlier chunks hold)."""
        self.lengths[row] = start
        self.kv.lengths[row] = min(int(self.kv.lengths[row]), max(start - 1, 0))

    def rollback(self, rows: list[int], lengths: list[int]) -> None:
        """Rows `rows` keep their first lengths[i] positions."""
        for row, n in zip(rows, lengths):
            if not 0 <= n <= int(self.lengths[row]):
                raise ValueError(f"cannot roll row {row} of length {int(self.lengths[row])} to {n}")
            self.lengths[row] = n
            self.kv.lengths[row] = min(int(self.kv.lengths[row]), max(n - 1, 0))

    def swap_rows(self, a: int, b: int) -> None:
        pair = [b, a]
        self.states[[a, b]] = self.states[pair]
        self.tokens[[a, b]] = self.tokens[pair]
        self.lengths[[a, b]] = self.lengths[pair]
        self.kv.swap_rows(a, b)

    # ---- drafting --------------------------------------------------------------------------------
    def _attend(self, rows: list[int], width: int, seen: torch.Tensor, T: int, causal: torch.Tensor | None):
        """The cached K/V of `rows` (their first `width` slots) and the mask of T queries over them
        and the new keys: cached slot j seen where seen[r, j], new key t' by query t where causal[t, t']."""
        past_k, past_v = self.kv.prefix(rows, width)
        new = torch.ones(T, T, dtype=torch.bool) if causal is None else causal
        mask = torch.cat([seen[:, None, :].expand(-1, T, -1), new[None].expand(len(rows), -1, -1)], dim=-1)
        return past_k[0], past_v[0], mask[:, None].to(past_k.device)

    def _pending_entries(self, rows: list[int], anchors: list[int], positions: list[int]):
        """Step 1's inputs: each row's entries not yet run, the last one (anchor, taps at a-1) drafting
        a+1; the rows' K/V lengths moved back to the entries already run → lengths [R], done [R],
        pending [R] (>= 1), ids [R, T], states [R, T, H] (T = the most pending)."""
        R = len(rows)
        lengths = self.lengths[rows]
        if positions != lengths.tolist():
            raise LoopspecError(
                "an EAGLE-3 stage starts right after its row's context (anchor at the context's "
                f"length): positions {positions}, context lengths {lengths.tolist()}"
            )
        if bool((lengths < 1).any()):
            raise LoopspecError("an EAGLE-3 stage needs the target's taps of at least one position before the anchor")
        done = torch.minimum(self.kv.lengths[rows], lengths - 1)  # the last entry waits for its anchor
        self.kv.lengths[rows] = done
        pending = lengths - done  # >= 1
        T = int(pending.max())
        ids = torch.zeros(R, T, dtype=torch.long)
        states = torch.zeros(R, T, self.states.shape[-1], dtype=self.states.dtype, device=self.states.device)
        for i, row in enumerate(rows):
            first, n = int(done[i]), int(pending[i])
            ids[i, :n] = self.tokens[row, first + 1 : first + n + 1]
            ids[i, n - 1] = anchors[i]  # the token after the last context position
            states[i, :n] = self.states[row, first : first + n]
        return lengths, done, pending, ids, states

    def _first_step(
        self, rows: list[int], anchors: list[int], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's pending entries, the last one (anchor, taps at a-1) drafting a+1; their K/V
        kept → the rows' lengths [R], the last entry's state [R, H] and its output [R, H]."""
        drafter, dev = self.drafter, self.states.device
        R = len(rows)
        lengths, done, pending, ids, states = self._pending_entries(rows, anchors, positions)
        T = ids.shape[1]
        pos = done[:, None] + torch.arange(T)[None, :]
        width = int(done.max())
        seen = torch.arange(width)[None, :] < done[:, None]
        past_k, past_v, mask = self._attend(rows, width, seen, T, torch.tril(torch.ones(T, T, dtype=torch.bool)))
        out, k, v = drafter(
            self.embed(ids.to(dev)), states, pos.clamp_max(self.max_length - 1).to(dev), past_k, past_v, mask
        )
        self.kv.append(k[None], v[None], rows, pending)
        return lengths, states[torch.arange(R), pending - 1], out[torch.arange(R), pending - 1]

    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ) -> StageDrafts:
        drafter, dev = self.drafter, self.states.device
        R, D = len(rows), block_size - 1
        lengths, first_state, last = self._first_step(rows, anchors, positions)  # last [R, H]: the logits read it
        state = drafter.next_state(last)  # [R, H]: the next step reads it
        hidden = [first_state, state]  # the stage's states 0 (fused taps at a-1), 1..
        sampler = DraftSampler(sampling, drafter.cfg.vocab_size, self.draft_ids) if sampling is not None else None
        logits = []
        # steps i + 1 = 2..D: (draft i, state i) at a+i-1 over the row's entries and the steps before
        seen = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
        step_k, step_v = [], []
        for i in range(1, D + 1):
            z = drafter.logits(last)  # [R, Vd]
            logits.append(z)
            index = sampler.choose(z) if sampler is not None else z.argmax(-1)
            token = self.draft_ids[index.to(dev)] if self.draft_ids is not None else index.to(dev)
            if i < D:  # the drafts past the anchor, for a later stage's entries (DLoop's pseudo-context)
                self.tokens[rows, lengths + i] = token.cpu()
            if i == D:
                break
            past_k, past_v, mask = self._attend(rows, int(lengths.max()), seen, 1, None)
            if step_k:
                past_k, past_v = torch.cat([past_k] + step_k, dim=2), torch.cat([past_v] + step_v, dim=2)
                mask = torch.cat(
                    [
                        mask[..., : seen.shape[1]],
                        torch.ones(R, 1, 1, len(step_k), dtype=torch.bool, device=mask.device),
                        mask[..., seen.shape[1] :],
                    ],
                    -1,
                )
            out, k, v = drafter(
                self.embed(token[:, None]),
                state[:, None],
                (lengths + i - 1)[:, None].clamp_max(self.max_length - 1).to(dev),
                past_k,
                past_v,
                mask,
            )
            step_k.append(k)
            step_v.append(v)
            last = out[:, 0]
            state = drafter.next_state(last)
            hidden.append(state)
        hidden = torch.stack(hidden, dim=1)  # [R, k, H]
        if sampler is not None:
            drafts, logq, q = sampler.drafts()
            return StageDrafts(drafts, logq, hidden, None, q)
        drafts, logprobs = draft_candidates(torch.stack(logits, dim=1), self.draft_ids)  # [R, D, C] each
        return StageDrafts(drafts.cpu(), logprobs.float().cpu(), hidden)

    def draft_dynamic(
        self, rows: list[int], anchors: list[int], positions: list[int], top_k: int, depth: int
    ) -> list[DynamicTree]:
        """EAGLE-2's dynamic tree for each of `rows` (loopspec/tree.py `DynamicTree`): step 1 as a
        stage's, its top-K drafts the first depth; then `depth` - 1 steps, each running the top-K
        nodes of the newest depth by cumulative log-prob at once, node n as the entry (n's token, the
        state its parent's step returned) at a + depth(n) - 1, attending to the row's entries, to the
        entries of its own ancestors and to itself (tree attention: never a sibling's path), and
        giving it its top-K children. The steps' K/V are dropped after the tree (as a stage's)."""
        drafter, dev = self.drafter, self.states.device
        R = len(rows)
        lengths, _, last = self._first_step(rows, anchors, positions)
        K = min(top_k, self.drafter.cfg.draft_vocab_size)
        trees = [DynamicTree(a) for a in anchors]

        def expand(parents: list[list[int]], outs: torch.Tensor) -> None:  # outs [R, n, H]
            ids, logprobs = draft_candidates(drafter.logits(outs), self.draft_ids, top_k=K)  # [R, n, K] each
            ids, logprobs = ids.cpu().tolist(), logprobs.double().cpu().tolist()
            for r, tree in enumerate(trees):
                for j, node in enumerate(parents[r]):
                    tree.add_children(node, ids[r][j], logprobs[r][j])

        expand([[0]] * R, last[:, None])
        width = int(lengths.max())
        seen = torch.arange(width)[None, :] < lengths[:, None]  # [R, W]
        step_k, step_v, slots = [], [], [[] for _ in rows]  # slots[r]: the node each kept entry ran for
        state_of = [{} for _ in rows]  # node → the state its step returned (what its children run with)
        for d in range(1, depth):
            chosen = [tree.frontier(d, K) for tree in trees]  # K nodes each: depth d holds K or K·K
            n = len(chosen[0])
            tokens = torch.tensor([[tree.tokens[c] for c in nodes] for tree, nodes in zip(trees, chosen)])
            outs = torch.stack(
                [
                    torch.stack([last[r] if d == 1 else state_of[r][trees[r].parents[c]] for c in nodes])
                    for r, nodes in enumerate(chosen)
                ]
            )  # [R, n, H]: the parents' outputs
            states = drafter.next_state(outs)  # [R, n, H]: what each node's step reads of its parent's
            ancestry = torch.tensor(
                [
                    [[slot in set(tree.ancestors(c)) for slot in row_slots] for c in nodes]
                    for tree, nodes, row_slots in zip(trees, chosen, slots)
                ],
                dtype=torch.bool,
            ).reshape(R, n, len(slots[0]))  # [R, n, S]
            mask = torch.cat(
                [seen[:, None, :].expand(-1, n, -1), ancestry, torch.eye(n, dtype=torch.bool)[None].expand(R, -1, -1)],
                dim=-1,
            )  # [R, n, W + S + n]
            past_k, past_v = self.kv.prefix(rows, width)
            past_k, past_v = torch.cat([past_k[0]] + step_k, dim=2), torch.cat([past_v[0]] + step_v, dim=2)
            pos = (lengths + d - 1)[:, None].expand(-1, n).clamp_max(self.max_length - 1)
            out, k, v = drafter(self.embed(tokens.to(dev)), states, pos.to(dev), past_k, past_v, mask[:, None].to(dev))
            step_k.append(k)
            step_v.append(v)
            for r, nodes in enumerate(chosen):
                slots[r] += nodes
                state_of[r].update({c: out[r, j] for j, c in enumerate(nodes)})
            expand(chosen, out)
        return trees
