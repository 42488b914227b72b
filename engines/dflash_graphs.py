"""A block drafter's context on an artifact backend (ONNX Runtime, TensorRT): the `DrafterContext`
(engines/protocol.py) of engines/dflash_context.py run by the exported graphs engines/specs.py
declares — `drafter_context` (the target's taps → every layer's context K/V), `drafter_context_hidden`
(DLoop's pseudo-features → the same) and `drafter_block` (one stage, its draft step inside the graph:
the draft head with DSpark's heads, or a DFlash2 drafter's selector walk).

Each row's context K/V live in a `KVCache` whose buffers are as wide as the rows need; a stage passes
the rows' context at least as wide as the longest row plus the block (room the graph writes the
block's K/V into) and each row's length (the graph masks the rest).
"""

from __future__ import annotations

import copy

import torch

from loopspec.engines.dflash_context import KVRows
from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, past_width
from loopspec.errors import LoopspecError
from loopspec.model.dflash import DrafterConfig
from loopspec.model.draft_head import StageDrafts
from loopspec.model.kv_cache import KVCache, SlotGrowth
from loopspec.tree import DynamicTree


class DFlashGraphs(KVRows):
    graphs = (DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK)  # the graphs it runs, beside the target's
    cache_graph = DRAFTER_BLOCK  # the graph whose context K/V inputs its cache feeds
    grows_dynamic_trees = False

    def __init__(self, engine, cfg: DrafterConfig, rows: int, max_length: int, dtype: torch.dtype, growth: SlotGrowth):
        """`engine`: the ArtifactEngine whose runners, device and dense copies (`dense`) it uses."""
        self.engine, self.cfg, self.max_length = engine, cfg, max_length
        self.dtype, self.growth = dtype, growth
        self.kv = self._new_kv(rows)

    def _new_kv(self, rows: int) -> KVCache:
        return KVCache(
            self.cfg.num_layers,
            rows,
            self.cfg.num_kv_heads,
            self.max_length,
            self.cfg.head_dim,
            self.dtype,
            self.engine.device,
            self.growth,
        )

    def with_rows(self, max_rows: int) -> "DFlashGraphs":
        twin = copy.copy(self)
        twin.kv = self._new_kv(max_rows)
        return twin

    # ---- the context ------------------------------------------------------------------------------
    def append_taps(self, rows: list[int], taps: torch.Tensor, counts: list[int]) -> None:
        self._append(DRAFTER_CONTEXT, "taps", rows, taps, counts)

    def append_pseudo(self, rows: list[int], hidden: torch.Tensor) -> None:
        self._append(DRAFTER_CONTEXT_HIDDEN, "hidden", rows, hidden.contiguous(), [hidden.shape[1]] * len(rows))

    def _append(self, graph: str, name: str, rows: list[int], features: torch.Tensor, counts: list[int]) -> None:
        # each row from its own length; right padding may run past the end (clamped, never stored)
        positions = (self.kv.lengths[rows][:, None] + torch.arange(features.shape[1])[None, :]).clamp_max(
            self.max_length - 1
        )  # [R, T]
        out = self.engine.runners[graph].run(**{name: features, "positions": positions})
        self.kv.append(out["context_key"], out["context_value"], rows, counts)

    # ---- drafting ---------------------------------------------------------------------------------
    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ) -> StageDrafts:
        if sampling is not None:
            raise LoopspecError(
                "the exported drafter graph returns each position's best drafts, not the "
                "distribution they come from: sample drafts on --backend torch"
            )
        R, k = len(rows), block_size
        lengths = self.kv.lengths[rows]  # [R]
        context_key, context_value = self.kv.dense_prefix(rows, past_width(lengths, k))  # with room for the block
        ids = torch.full((R, k), self.cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(anchors)
        out = self.engine.runners[DRAFTER_BLOCK].run(
            block_ids=ids,
            positions=torch.tensor(positions)[:, None] + torch.arange(k),
            context_key=self.engine.dense("context_key", context_key, per_layer=False),
            context_value=self.engine.dense("context_value", context_value, per_layer=False),
            context_lengths=lengths,
        )
        confidence = out.get("confidence")  # [R, D]: declared by the spec when the drafter has a confidence head
        return StageDrafts(
            out["draft_ids"].cpu(),
            out["draft_logprobs"].float().cpu(),
            out["hidden"],
            None if confidence is None else confidence.float().cpu(),
        )

    def draft_dynamic(
        self, rows: list[int], anchors: list[int], positions: list[int], top_k: int, depth: int
    ) -> list[DynamicTree]:
        raise LoopspecError(
            "a dynamic draft tree needs a drafter that drafts step by step (EAGLE-3) on --backend torch"
        )
