"""An EAGLE-3 drafter's context on an artifact backend (ONNX Runtime, TensorRT): the torch engine's
`Eagle3Context` (engines/eagle3_context.py) — the same fused states, tokens, lengths and one-layer
K/V per row, kept and rolled back by the same code — with its forwards run by the exported graphs of
engines/eagle3_specs.py: `eagle3_fuse` for the fused taps, `eagle3_step` for every drafter step.

A stage runs as the torch engine runs it: its first step is every row's pending entries (the last
one (anchor, fused taps at a-1) drafts the token at a+1), whose K/V the context keeps; each later
step is one entry per row (the draft before it and the state the step before returned, at a+i-2).
The later steps' K/V are written after the row's entries, where the next step's call reads them,
and dropped when the stage ends (the row's K/V length set back), as the torch engine drops them.
"""

from __future__ import annotations

import torch

from loopspec.engines.eagle3_context import Eagle3Context
from loopspec.engines.eagle3_specs import EAGLE3_ENGINES, EAGLE3_FUSE, EAGLE3_STEP
from loopspec.engines.specs import past_width
from loopspec.errors import LoopspecError
from loopspec.model.draft_head import StageDrafts
from loopspec.model.eagle3 import Eagle3Config
from loopspec.model.kv_cache import KVCache, SlotGrowth
from loopspec.tree import DynamicTree


class Eagle3Graphs(Eagle3Context):
    graphs = EAGLE3_ENGINES  # the graphs it runs, beside the target's
    cache_graph = EAGLE3_STEP  # the graph whose context K/V inputs its cache feeds
    grows_dynamic_trees = False  # the step graph runs one entry per row: no tree attention

    def __init__(self, engine, cfg: Eagle3Config, rows: int, max_length: int, dtype: torch.dtype, growth: SlotGrowth):
        """`engine`: the ArtifactEngine whose runners, device and dense copies (`dense`) it uses."""
        self.engine, self.cfg, self.max_length = engine, cfg, max_length
        self.dtype, self.device, self.growth = dtype, engine.device, growth
        self._new_rows(rows)

    def _new_kv(self, rows: int) -> KVCache:
        # room past max_length for a stage's later steps, whose K/V sit after the row's entries until it ends
        return KVCache(
            1, rows, self.cfg.num_kv_heads, 2 * self.max_length, self.cfg.head_dim, self.dtype, self.device, self.growth
        )

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's taps [R, T, 3·H_target] → the fused states [R, T, H] (`eagle3_fuse`)."""
        return self.engine.runners[EAGLE3_FUSE].run(taps=taps.contiguous())["states"]

    def _step(
        self,
        rows: list[int],
        ids: torch.Tensor,
        states: torch.Tensor,
        positions: torch.Tensor,
        logit_index: torch.Tensor,
        counts: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """One `eagle3_step` call: `rows`' entries ids/states/positions [R, T(, H)] after their K/V; the
        first counts[i] entries' K/V are kept at row i's K/V length."""
        lengths = self.kv.lengths[rows]
        key, value = self.kv.dense_prefix(rows, past_width(lengths, ids.shape[1]))  # [1, R, kvh, W, hd], with room
        out = self.engine.runners[EAGLE3_STEP].run(
            token_ids=ids,
            states=states.contiguous(),
            positions=positions.clamp_max(self.max_length - 1),
            context_key=self.engine.dense("eagle3_key", key, per_layer=True)[0],
            context_value=self.engine.dense("eagle3_value", value, per_layer=True)[0],
            context_lengths=lengths,
            logit_index=logit_index,
        )
        self.kv.append(out["new_key"][None], out["new_value"][None], rows, counts)
        return out

    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ) -> StageDrafts:
        if sampling is not None:
            raise LoopspecError(
                "the exported EAGLE-3 graphs return each step's best drafts, not the distribution "
                "they come from: sample drafts on --backend torch"
            )
        R, D = len(rows), block_size - 1
        # step 1: each row's pending entries, the last one (anchor, taps at a-1) drafting a+1
        lengths, done, pending, ids, states = self._pending_entries(rows, anchors, positions)
        T = ids.shape[1]
        out = self._step(rows, ids, states, done[:, None] + torch.arange(T)[None, :], pending - 1, pending)
        hidden = [states[torch.arange(R), pending - 1], out["state"]]  # the stage's states 0 (fused taps at a-1), 1..
        drafts, logprobs = [], []
        # steps i + 1 = 2..D: (draft i, state i) at a+i-1 over the row's entries and the steps before
        for i in range(1, D + 1):
            drafts.append(out["draft_ids"])
            logprobs.append(out["draft_logprobs"])
            if i == D:
                break
            token = out["draft_ids"][:, 0].cpu()  # the chain: rank 0 (a TensorRT plan returns it on the GPU)
            self.tokens[rows, lengths + i] = token  # the drafts past the anchor, for a later stage's entries (DLoop)
            out = self._step(
                rows,
                token[:, None],
                out["state"][:, None],
                (lengths + i - 1)[:, None],
                torch.zeros(R, dtype=torch.long),
                torch.ones(R, dtype=torch.long),
            )
            hidden.append(out["state"])
        self.kv.lengths[rows] = lengths  # the later steps' K/V are dropped
        return StageDrafts(
            torch.stack(drafts, dim=1).cpu(), torch.stack(logprobs, dim=1).float().cpu(), torch.stack(hidden, dim=1)
        )  # [R, D, C], [R, D, C], [R, k, H]

    def draft_dynamic(
        self, rows: list[int], anchors: list[int], positions: list[int], top_k: int, depth: int
    ) -> list[DynamicTree]:
        raise LoopspecError(
            "the exported EAGLE-3 graphs run one entry per row a step, not a dynamic tree's "
            "nodes: grow it on --backend torch"
        )
