"""The Engine protocol: what the decoder calls, on every backend.

An engine owns the target's KV cache (`loopspec.model.kv_cache.KVCache`, or the windowed / recurrent
caches of the target families that need them) and the drafter's context (a `DrafterContext`), each
of `max_rows` rows with one length per row. Every call takes rows. The decoder keeps its live
rows packed at the front, so the per-round calls (verify, rollback, context append) are over rows
0..B-1; drafting calls name their rows, since DLoop's later stages run only for the rows whose gate
opened. A single request is one row; a prompt prefilled in chunks sits in another row until done.

Tensors that decide (logits, drafts, log-probs) come back on the CPU; features (taps, hidden states)
stay on the engine's device. An engine keeps its drafter's context in a `DrafterContext` (below), one
implementation per drafter family and backend (engines/drafter_contexts.py looks it up by the
drafter kind's `context`): an engine calls it and never asks which family it holds. Backends, all in
this package: torch_engine.py (PyTorch; cuda_graphs.py an option of it), ort_engine.py (ONNX Runtime)
and trt_engine.py (TensorRT), the last two over artifact_engine.py (the artifact contract: manifest,
specs, caches). Callers outside this package hold engines as `Engine` and reach nothing else of theirs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loopspec.model.dflash import DrafterConfig
from loopspec.model.draft_head import StageDrafts
from loopspec.model.target import TargetConfig
from loopspec.tree import DynamicTree


class DrafterContext(Protocol):
    """A drafter's per-row context and its stages, what an engine delegates every drafter call to:
    the block drafters' (DFlash, DSpark, DFlash2: every drafter layer's K/V of the target's context
    features; a stage is one forward over [anchor, MASK…]) and EAGLE-3's (fused taps paired with
    the next token; a stage is one drafter step a draft). Rows, lengths and rollback as the engine's."""

    lengths: torch.Tensor  # [max_rows]: the positions each row's context holds
    grows_dynamic_trees: bool  # `draft_dynamic` runs (a drafter that drafts step by step)

    def with_rows(self, max_rows: int) -> "DrafterContext":
        """The same drafter (modules, graphs, draft head) over fresh rows."""

    def target_wrote(self, rows: list[int], starts: list[int], tokens: list[list[int]]) -> None:
        """The target stored tokens[i] at slots starts[i].. of rows[i] (a prefill, or a verification)."""

    def target_committed(self, starts: list[int], kept: list[list[int]]) -> None:
        """As the target's cache commits (Engine.target_commit)."""

    def restart(self, row: int, start: int) -> None:
        """`row` starts over at `start` (a prefill: 0, or the prompt positions its earlier chunks hold)."""

    def append_taps(self, rows: list[int], taps: torch.Tensor, counts: list[int]) -> None:
        """`rows` append the context of their first counts[i] target taps [R, T, n*H]."""

    def append_pseudo(self, rows: list[int], hidden: torch.Tensor) -> None:
        """DLoop: `rows` append the drafter's own states hidden [R, T, H] as context."""

    def rollback(self, rows: list[int], lengths: list[int]) -> None: ...

    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ) -> StageDrafts:
        """One stage for each of `rows` (Engine.draft)."""

    def draft_dynamic(
        self, rows: list[int], anchors: list[int], positions: list[int], top_k: int, depth: int
    ) -> list[DynamicTree]:
        """EAGLE-2's dynamic tree for each of `rows` (Engine.draft_dynamic)."""

    def swap_rows(self, a: int, b: int) -> None: ...


class Engine(Protocol):
    backend: str  # "torch" | "onnxruntime" | "tensorrt"
    precision: str  # what the target computes with: "fp32", "gguf-int8act", ... (engines/manifest.py)
    block_types: tuple[str, ...]  # the GGUF types of a target over a file's own blocks ("Q4_1", "Q8_0"); else ()
    device: torch.device
    target_cfg: TargetConfig
    drafter_cfg: DrafterConfig | None  # None: no drafter (plain decoding only)
    max_rows: int
    max_context: int  # the most positions a row may hold
    # True where only chains verify exactly: an int8-activation engine exported before the
    # order-free softmax (its softmax sums a tree node's exps in another order than plain decoding,
    # masked siblings between its ancestors, and int8 rounding turns those last bits into other tokens),
    # or a TensorRT plan in fp16/bf16/fp8/nvfp4 (the same reordering, rounded at reduced precision),
    # or a target with linear-attention layers (its recurrent state follows one path, not a tree)
    chains_only: bool
    # > 0 where a draft tree verifies exactly only inside one aligned block of this many slots: the
    # value product sums its reduction in blocks (ONNX Runtime's fp32 MatMul: 256 slots at head dim
    # 64), and a tree node sits at a later slot than plain decoding puts it (after its siblings), so
    # a block boundary between the two slots groups its sum differently. The decoder verifies the
    # chain in a round whose tree would straddle one. 0: trees anywhere.
    tree_span: int
    # True where `draft` takes `sampling` (DecodingSettings.draft_sampling "drafter"): it samples
    # the drafts from the drafter's distribution q and returns q, which speculative sampling needs
    samples_drafts: bool
    grows_dynamic_trees: bool  # `draft_dynamic` runs (EAGLE-2's dynamic tree, for a drafter kind that grows one)

    @property
    def has_drafter(self) -> bool: ...

    def with_rows(self, max_rows: int) -> "Engine":
        """The same models (weights, sessions, plans) with fresh caches of `max_rows` rows."""

    # ---- target ----------------------------------------------------------------------------------
    def prefill(self, row: int, prompt_ids: list[int], want_taps: bool, start: int = 0) -> torch.Tensor:
        """Start `row` with a prompt (its caches restart at `start`: 0, or the prompt tokens an
        earlier chunk of the same prompt holds; with `want_taps` its drafter context holds every
        prompt position's features) → the last position's logits [V]."""

    def verify(
        self, tokens: list[list[int]], want_taps: bool, tree_masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows 0..B-1 run their tokens after their own KV → logits [B, T, V] and taps [B, T, n*H]
        (T = the longest row; padding positions are junk; taps None when not wanted). The tokens are
        a chain, or with `tree_masks` (bool [B, T, T], loopspec.tree.tree_masks) a draft tree each:
        token t sees its row's history and the tokens tree_masks[b, t] marks, at the row's length +
        its depth. Either way token t's K/V go to slot length + t."""

    def target_rollback(self, lengths: list[int]) -> None:
        """Rows 0..B-1 keep their first lengths[b] KV slots."""

    def target_commit(self, starts: list[int], kept: list[list[int]]) -> None:
        """After a verification from lengths `starts`: rows 0..B-1 keep the verified tokens at
        offsets kept[b] (ascending from 0, the accepted path), moved into place; the rest is dropped."""

    # ---- drafter context -------------------------------------------------------------------------
    def append_context(self, taps: torch.Tensor, counts: list[int]) -> None:
        """Rows 0..B-1 append the context features of their first counts[b] taps [B, T, n*H]."""

    def append_pseudo_context(self, rows: list[int], hidden: torch.Tensor) -> None:
        """DLoop: `rows` append H-dim pseudo-features hidden [R, T, H] (the drafter's own states)."""

    def context_lengths(self, rows: list[int]) -> list[int]: ...

    def context_rollback(self, rows: list[int], lengths: list[int]) -> None: ...

    # ---- drafter ---------------------------------------------------------------------------------
    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ) -> StageDrafts:
        """One stage for each of `rows`: [anchor, MASK × (k-1)] at positions .. positions+k-1 on the
        row's own context → each drafting position's C best drafts [R, D, C] (target ids, rank 0 the
        argmax), their log-probs [R, D, C], final-norm hidden states [R, k, H]. D = k-1 for z-lab's
        block convention, k for DeepSpec's (`DrafterConfig.anchor_predicts`), as a `StageDrafts`
        (unpacks as those three), whose `.confidence` [R, D] carries a confidence head's estimates
        (None without one).
        `sampling` (engines with `samples_drafts`): each row's (SamplingParams, torch.Generator);
        each position's one draft is then sampled from the drafter's warped distribution q with
        the row's generator (C = 1, log-probs log q), and the `StageDrafts` carries q [R, D, V]
        as `.q` (loopspec.model.dflash.sample_stage)."""

    def draft_dynamic(
        self, rows: list[int], anchors: list[int], positions: list[int], top_k: int, depth: int
    ) -> list[DynamicTree]:
        """EAGLE-2's dynamic tree for each of `rows` (DecodingSettings.tree_kind "dynamic"; only an
        engine whose drafter kind `grows_dynamic_trees` — EAGLE-3 on the torch engine — is asked):
        `depth` drafter steps from the anchor at `positions`, each expanding the `top_k` best nodes of
        the newest depth, each under its own path, into `top_k` children → every drafted node with its
        cumulative log-prob (loopspec.tree.DynamicTree); the context keeps its length, as after a stage."""

    # ---- rows ------------------------------------------------------------------------------------
    def swap_rows(self, a: int, b: int) -> None:
        """Rows a and b exchange their caches (retiring a row keeps the live ones packed; a prompt
        prefilled in chunks joins them)."""
