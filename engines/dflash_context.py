"""A block drafter's context on the torch engine (DFlash, DSpark, DFlash2): the `DrafterContext`
(engines/protocol.py) of every drafter whose stage is one forward over [anchor, MASK × (k-1)].

Each row keeps every drafter layer's K/V of its context features (`kv`, a KVCache with a length
per row): hidden_norm(fc(taps)) of the target's taps, or DLoop's pseudo-features (the drafter's own
states), projected by each layer's k_proj / v_proj with k_norm and RoPE at their positions. A stage
embeds its block with the target's embedding, attends to the row's live context and the whole
block, and hands its final-norm states to the drafter's own draft step (`stage_drafts`: the draft
head with DSpark's heads, or DFlash2's candidate selector). The target's tokens are not needed.
"""

from __future__ import annotations

import copy

import torch

from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.model.draft_head import StageDrafts, draft_head_weight
from loopspec.model.kv_cache import KVCache
from loopspec.model.target import Target, inference_linear
from loopspec.tree import DynamicTree


class KVRows:
    """What a block drafter's context does with its rows, on any backend: every drafter layer's
    context K/V in `kv` (a KVCache with a length per row); it reads the target's taps only, so the
    target's writes and commits change nothing here."""

    kv: KVCache

    @property
    def lengths(self) -> torch.Tensor:
        return self.kv.lengths

    def target_wrote(self, rows: list[int], starts: list[int], tokens: list[list[int]]) -> None:
        pass

    def target_committed(self, starts: list[int], kept: list[list[int]]) -> None:
        pass

    def restart(self, row: int, start: int) -> None:
        self.kv.lengths[row] = start

    def rollback(self, rows: list[int], lengths: list[int]) -> None:
        self.kv.rollback(lengths, rows)

    def swap_rows(self, a: int, b: int) -> None:
        self.kv.swap_rows(a, b)


class DFlashContext(KVRows):
    grows_dynamic_trees = False  # a block drafts every position in one forward, after the anchor alone

    def __init__(self, drafter: Drafter, target: Target, max_length: int, rows: int):
        self.drafter, self.embed, self.max_length = drafter, target.embed_tokens, max_length
        self.device = target.embed_tokens.weight.device
        # a reduced draft vocabulary drafts over its rows of the target's lm_head only (a cheaper stage)
        self.draft_ids = drafter.draft_ids.to(self.device) if drafter.draft_ids is not None else None
        self.draft_head = (
            inference_linear(draft_head_weight(target.lm_head.weight, self.draft_ids))
            if self.draft_ids is not None
            else target.lm_head
        )
        self.kv = drafter.new_context(max_length, rows)

    def with_rows(self, max_rows: int) -> "DFlashContext":
        twin = copy.copy(self)  # the same drafter and draft head
        twin.kv = self.drafter.new_context(self.max_length, max_rows)
        return twin

    # ---- the context ------------------------------------------------------------------------------
    def append_taps(self, rows: list[int], taps: torch.Tensor, counts: list[int]) -> None:
        self._append(rows, self.drafter.features(taps), counts)

    def append_pseudo(self, rows: list[int], hidden: torch.Tensor) -> None:
        self._append(rows, hidden, [hidden.shape[1]] * len(rows))

    def _append(self, rows: list[int], features: torch.Tensor, counts: list[int]) -> None:
        # features [R, T, H] at each row's next positions (padding may run past the end: clamped, never stored)
        positions = self.kv.lengths[rows][:, None] + torch.arange(features.shape[1])[None, :]  # [R, T]
        k, v = self.drafter.context_kv(features, positions.clamp_max(self.max_length - 1).to(self.device))
        self.kv.append(k, v, rows, counts)

    # ---- drafting ---------------------------------------------------------------------------------
    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ) -> StageDrafts:
        R, k = len(rows), block_size
        lengths = self.kv.lengths[rows]  # [R]
        width = int(lengths.max())
        ctx_k, ctx_v = self.kv.prefix(rows, width)
        mask = None
        if bool((lengths != width).any()):  # shorter contexts hide their stale slots; the block sees all
            seen = torch.arange(width + k)[None, :]
            mask = ((seen < lengths[:, None]) | (seen >= width))[:, None, None, :].to(
                self.device
            )  # [R, 1, 1, width + k]
        ids = torch.full((R, k), self.drafter.cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(anchors)
        pos = (torch.tensor(positions)[:, None, None] + torch.arange(k)).to(self.device)  # [R, 1, k]
        ids = ids.to(self.device)
        hidden = self.drafter(self.embed(ids), pos, ctx_k, ctx_v, mask)  # [R, k, H]
        return self.drafter.stage_drafts(hidden, ids[:, 0], self.draft_head, self.draft_ids, sampling)

    def draft_dynamic(
        self, rows: list[int], anchors: list[int], positions: list[int], top_k: int, depth: int
    ) -> list[DynamicTree]:
        raise LoopspecError("a dynamic draft tree needs a drafter that drafts step by step (EAGLE-3)")
