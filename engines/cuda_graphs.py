"""CUDA graphs for the torch backend: the target-verify and drafter-block forwards are captured once per
(rows, length, window) bucket over static buffers and replayed with padding.

A CUDA graph replays fixed kernels on fixed addresses, so nothing inside it may depend on a Python
int that changes between calls (the cache lengths, the context lengths). The captured forwards
therefore take positions, slots and lengths as tensors and see a fixed-size window of the static
buffers, the first `keys` slots (a power of two >= what the call needs, so attention costs at most
twice the live length):
- target verify: each row's T_b real tokens (a chain or a draft tree) are padded to the bucket
  length with a chain that continues after them. Slots, positions and the attention mask over the
  window are input buffers, built on the host by `plan_verify` with the eager forward's own rule
  (`attention_mask`): a real query never sees a padding key nor a stale slot past its row's length;
  the padding's K/V land in slots past the row's new length, which the next forward overwrites
  before any query can see them. Outputs are sliced to the real tokens.
- drafter block: each row's block attends to its context window with the mask `context slot <
  its context length` (a tensor) plus the whole block (bidirectional); `plan_block` builds it.
Calls that fit no bucket (a long prefill, the last slots of the context, rows not packed from 0)
run eagerly.

The planning (`plan_verify`, `plan_block`: which bucket, window, slots, positions, masks and new
lengths) is pure host code, and the static forwards run on any device: `StaticRunner` runs them
directly (the CPU path the tests decode with, and mutate), `CudaGraphRunner` captures and replays
them. Both share every line that decides what a replay computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.model.draft_head import StageDrafts, draft_stage
from loopspec.model.kv_cache import KVCache, KVWrite, attention_mask
from loopspec.model.target import LayerStep, Target, TargetOutput

# verify lengths: 1 (plain decoding) up to a DLoop chain of 4 stages of 16 (61 tokens)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEYS = 64  # the smallest attention window


def key_bucket(needed: int, max_length: int) -> int:
    """The attention window for `needed` live slots: the next power of two (>= MIN_KEYS), at most the buffer."""
    keys = MIN_KEYS
    while keys < needed:
        keys *= 2
    return min(keys, max_length)


def require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise LoopspecError(
            f"CUDA graphs need a CUDA device; the models are on {device} "
            "(run with --device cuda on a GPU, or --no-cuda-graphs)"
        )
    if not torch.cuda.is_available():
        raise LoopspecError("CUDA graphs need a CUDA GPU, and torch sees none")


class VerifyPlan(NamedTuple):
    """Everything a static verify needs, built on the host (see `plan_verify`)."""

    bucket: int  # tokens per row, padding included
    keys: int  # the attention window: slots 0..keys-1
    ids: torch.Tensor  # [R, bucket]
    positions: torch.Tensor  # [R, bucket]
    slots: torch.Tensor  # [R·bucket]: row_index[i]'s token token_index[i] is stored at slots[i]
    row_index: torch.Tensor  # [R·bucket]
    token_index: torch.Tensor  # [R·bucket]
    mask: torch.Tensor  # [R, bucket, keys]
    lengths: list[int]  # each row's length after the call: start + its real tokens


def plan_verify(
    starts: list[int], tokens: list[list[int]], max_length: int, tree_masks: torch.Tensor | None = None
) -> VerifyPlan | None:
    """Rows 0..R-1 (lengths `starts`) verify `tokens` (chains, or draft trees with `tree_masks` [R, T, T])
    → the static verify's inputs, or None when no bucket holds the widest row at these lengths.

    Row b's token t is stored at slot starts[b] + t and sits at starts[b] + its depth; the padding
    continues a chain after the real tokens (no real token sees it; its K/V land past the row's new
    length). The mask is the eager forward's (`attention_mask`)."""
    rows, width, top = len(tokens), max(len(t) for t in tokens), max(starts)
    bucket = next((b for b in BUCKETS if b >= width and top + b <= max_length), None)
    if bucket is None:
        return None
    keys = key_bucket(top + bucket, max_length)
    ids = torch.zeros(rows, bucket, dtype=torch.long)  # padding: token 0, after the real tokens
    tree = torch.ones(bucket, bucket, dtype=torch.bool).tril().repeat(rows, 1, 1)
    for b, t in enumerate(tokens):
        ids[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        if tree_masks is not None:
            tree[b, : len(t), : len(t)] = tree_masks[b, : len(t), : len(t)]
    start = torch.tensor(starts, dtype=torch.long)
    positions = start[:, None] + tree.sum(-1) - 1  # [R, bucket]: a node's depth after its row's length
    row_index = torch.arange(rows).repeat_interleave(bucket)
    token_index = torch.arange(bucket).repeat(rows)
    slots = start[row_index] + token_index
    mask = attention_mask(start, bucket, keys, tree)  # [R, bucket, keys]
    return VerifyPlan(
        bucket, keys, ids, positions, slots, row_index, token_index, mask, [s + len(t) for s, t in zip(starts, tokens)]
    )


class BlockPlan(NamedTuple):
    """Everything a static drafter block needs, built on the host (see `plan_block`)."""

    keys: int  # the context window: slots 0..keys-1
    ids: torch.Tensor  # [R, k]: anchor, then MASK
    positions: torch.Tensor  # [R, k]
    context_lengths: torch.Tensor  # [R]: each row's live context slots


def plan_block(
    context_lengths: list[int],
    anchors: list[int],
    positions: list[int],
    block_size: int,
    mask_token_id: int,
    max_length: int,
) -> BlockPlan:
    """Rows 0..R-1 (context lengths given) draft a block [anchor, MASK × (k-1)] at positions .. +k-1."""
    keys = key_bucket(max(context_lengths), max_length)
    ids = torch.full((len(anchors), block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = torch.tensor(anchors, dtype=torch.long)
    block_positions = torch.tensor(positions, dtype=torch.long)[:, None] + torch.arange(block_size)
    return BlockPlan(keys, ids, block_positions, torch.tensor(context_lengths, dtype=torch.long))


def target_verify_static(
    target: Target,
    cache: KVCache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    row_index: torch.Tensor,
    token_index: torch.Tensor,
    mask: torch.Tensor,
    want_taps: bool,
) -> TargetOutput:
    """The target over ids/positions [R, T] in rows 0..R-1 of `cache` with static shapes (its lengths
    are neither read nor moved): row_index[i]'s token token_index[i] is stored at slots[i], and token t
    of row b sees the slots mask[b, t] marks among the first `keys` = mask.shape[-1].

    Row b's token t equals the eager forward's whenever its slots continue the row's cache and
    positions/mask are the eager forward's (as `plan_verify` builds them)."""
    cos, sin = target.rotary(positions)  # [R, T, hd]
    write = KVWrite(slice(0, ids.shape[0]), mask.shape[-1], slots=slots, row_index=row_index, token_index=token_index)
    step = LayerStep(cos[:, None], sin[:, None], cache, write, mask[:, None], positions)
    return target._stack(target.embed_tokens(ids), step, want_taps, None)


def drafter_block_static(
    drafter: Drafter,
    embed: torch.nn.Module,
    draft_head: torch.nn.Module,
    context: KVCache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    context_lengths: torch.Tensor,
    draft_ids: torch.Tensor | None,
    keys: int | None = None,
):
    """One stage over ids [R, k] at positions [R, k] against rows 0..R-1 of the context buffer, its
    first `keys` slots (default all), of which row b's first context_lengths[b] are live → StageDrafts:
    drafts [R, D, C], log-probs [R, D, C], hidden [R, k, H], confidence [R, D] or None (D = k-1 or k
    by the drafter's block convention)."""
    rows, k = ids.shape
    keys = keys or context.max_length
    live = torch.arange(keys, device=ids.device)[None, :] < context_lengths[:, None]  # [R, keys]
    visible = torch.cat([live, torch.ones(rows, k, dtype=torch.bool, device=ids.device)], dim=1)  # [R, keys + k]
    ctx_k, ctx_v = context.k[:, :rows, :, :keys], context.v[:, :rows, :, :keys]
    hidden = drafter(embed(ids), positions[:, None], ctx_k, ctx_v, visible[:, None, None, :])  # [R, k, H]
    drafts, logprobs, confidence = draft_stage(drafter, hidden, ids[:, 0], draft_head, draft_ids)  # [R, D, C] each
    return StageDrafts(drafts, logprobs, hidden, confidence)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static input buffers, refilled before each replay
    outputs: tuple  # static output tensors, overwritten by each replay


def capture(fn: Callable[[], tuple], inputs: dict[str, torch.Tensor]) -> Captured:
    """Warm up on a side stream (allocator, lazy kernel init), then capture one call of `fn`.

    The warm-up really runs: callers fill `inputs` with the call's real values first, so any cache
    write it makes is the one the replay makes again."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return Captured(graph, inputs, outputs)


class StaticRunner:
    """The bucketed static-buffer forwards over rows 0..R-1 of a TorchEngine's caches, run directly.

    This is what CudaGraphRunner replays, minus the capture: the same plans, the same static
    forwards, the same slicing of the outputs. It runs on any device, so the CPU decodes through it
    (and tests plant bugs in its plans to show that the identity checks catch them). `verify` and
    `draft` return None for a call no bucket holds; the engine then runs it eagerly.

    Results follow the engine's contract: decision tensors (logits, drafts, log-probs) come back on
    the CPU, features (taps, hidden states) stay on the models' device."""

    plan_verify = staticmethod(plan_verify)
    plan_block = staticmethod(plan_block)

    def __init__(self, engine):
        self.device = engine.device
        self.target, self.cache = engine.target, engine.cache
        # a block drafter's context (engines/dflash_context.py): its K/V, draft head and draft rows
        drafting = engine.context
        self.drafter = engine.drafter
        self.context = drafting.kv if drafting is not None else None
        self.draft_head = drafting.draft_head if drafting is not None else None
        self.draft_ids = drafting.draft_ids if drafting is not None else None
        self.mask_token_id = engine.drafter_cfg.mask_token_id if engine.drafter_cfg is not None else None

    def run(self, key: tuple, forward: Callable[[dict], tuple], values: dict[str, torch.Tensor]) -> tuple:
        """forward(inputs) on the call's values (CudaGraphRunner: a replay of its capture for `key`)."""
        return forward({name: t.to(self.device) for name, t in values.items()})

    # ---- target verify ---------------------------------------------------------------------------
    def verify(
        self, tokens: list[list[int]], want_taps: bool, tree_masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Rows 0..R-1 verify their tokens → logits [R, T, V] (CPU), taps [R, T, n*H] or None (device),
        T the widest row; advances each row's length by its tokens. None: no bucket holds the call."""
        rows = len(tokens)
        plan = self.plan_verify(self.cache.lengths[:rows].tolist(), tokens, self.cache.max_length, tree_masks)
        if plan is None:
            return None
        values = {
            "ids": plan.ids,
            "positions": plan.positions,
            "slots": plan.slots,
            "row_index": plan.row_index,
            "token_index": plan.token_index,
            "mask": plan.mask,
        }
        logits, taps = self.run(
            ("verify", rows, plan.bucket, plan.keys, want_taps),
            lambda v: tuple(
                target_verify_static(
                    self.target,
                    self.cache,
                    v["ids"],
                    v["positions"],
                    v["slots"],
                    v["row_index"],
                    v["token_index"],
                    v["mask"],
                    want_taps,
                )
            ),
            values,
        )
        self.cache.lengths[:rows] = torch.tensor(plan.lengths)
        width = max(len(t) for t in tokens)
        return logits[:, :width].float().cpu(), (taps[:, :width].clone() if taps is not None else None)

    # ---- drafter block ---------------------------------------------------------------------------
    def draft(self, rows: list[int], anchors: list[int], positions: list[int], block_size: int):
        """Rows 0..R-1 (packed: `rows` must be exactly those) → drafts [R, k-1, C] (CPU), log-probs
        (CPU), final-norm hidden states [R, k, H] (device); None for any other set of rows."""
        if rows != list(range(len(rows))):
            return None
        plan = self.plan_block(
            self.context.lengths[rows].tolist(),
            anchors,
            positions,
            block_size,
            self.mask_token_id,
            self.context.max_length,
        )
        values = {"ids": plan.ids, "positions": plan.positions, "lengths": plan.context_lengths}
        stage = self.run(
            ("block", len(rows), block_size, plan.keys),
            lambda v: drafter_block_static(
                self.drafter,
                self.target.embed_tokens,
                self.draft_head,
                self.context,
                v["ids"],
                v["positions"],
                v["lengths"],
                self.draft_ids,
                plan.keys,
            ),
            values,
        )
        (drafts, logprobs, hidden), confidence = stage, stage.confidence  # a replay returns the captured StageDrafts
        return StageDrafts(
            drafts.cpu(), logprobs.float().cpu(), hidden.clone(), None if confidence is None else confidence.cpu()
        )


class CudaGraphRunner(StaticRunner):
    """StaticRunner whose forwards are captured once per bucket key as CUDA graphs and replayed: the
    plans' tensors are copied into the capture's static input buffers before each replay."""

    def __init__(self, engine):
        require_cuda(engine.device)
        super().__init__(engine)
        self.graphs: dict[tuple, Captured] = {}

    def run(self, key: tuple, forward: Callable[[dict], tuple], values: dict[str, torch.Tensor]) -> tuple:
        captured = self.graphs.get(key)
        if captured is None:
            inputs = {name: t.to(self.device) for name, t in values.items()}
            captured = self.graphs[key] = capture(lambda: forward(inputs), inputs)
        else:
            for name, t in values.items():
                captured.inputs[name].copy_(t)
        captured.graph.replay()
        return captured.outputs
