"""CUDA graphs for the torch backend: the target-verify and drafter-block forwards are captured once per
(batch, length) bucket over static buffers and replayed with padding.

A CUDA graph replays fixed kernels on fixed addresses, so nothing inside it may depend on a Python
int that changes between calls (the cache length, the context length). The captured forwards
therefore take positions and lengths as tensors and see a fixed-size window of the static buffer,
the first `keys` slots (a power of two >= what the call needs, so attention costs at most twice
the live length):
- target verify: T real tokens are padded to the bucket length with positions that continue after
  them. Every query attends to the window with the mask `key slot <= own position`, so a real
  query never sees a padding key (padding sits after it) nor a stale slot past the cache length;
  the padding's K/V land in slots past the new length, which the next forward overwrites before any
  query can see them. Outputs are sliced to the real tokens.
- drafter block: the block attends to the context window with the mask `context slot < context
  length` (a tensor) plus the whole block (bidirectional).
Calls that fit no bucket (a long prefill, the last slots of the context) run eagerly.

Batch is 1 (an engine serves one request); the bucket key carries it so a batched engine can add rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loopspec.errors import LoopspecError
from loopspec.model.drafter import ContextCache, Drafter
from loopspec.model.target import KVCache, Target, TargetOutput

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
        raise LoopspecError(f"CUDA graphs need a CUDA device; the models are on {device} "
                            "(run with --device cuda on a GPU, or --no-cuda-graphs)")
    if not torch.cuda.is_available():
        raise LoopspecError("CUDA graphs need a CUDA GPU, and torch sees none")


class StaticStep:
    """KV writes at tensor positions into the static cache (the `store` step protocol of the target's
    attention), attention over its first `keys` slots: the same kernels whatever the cache length."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, keys: int):
        self.cache, self.positions, self.keys = cache, positions, keys  # positions: [T] slots (< keys)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [1, kvh, T, hd] → the layer's window [1, kvh, keys, hd] (masked by the caller)
        self.cache.k[layer].index_copy_(2, self.positions, k)
        self.cache.v[layer].index_copy_(2, self.positions, v)
        return self.cache.k[layer, :, :, :self.keys], self.cache.v[layer, :, :, :self.keys]


def target_verify_static(target: Target, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor,
                         want_taps: bool, keys: int | None = None) -> TargetOutput:
    """The target over ids/positions [1, T] with static shapes (cache.length is neither read nor moved),
    attending to the cache's first `keys` slots (default: all; every position must be below it).

    Row t equals the eager forward's row t whenever positions continue the cache (start .. start+T-1)."""
    keys = keys or cache.max_length
    slots = torch.arange(keys, device=ids.device)
    mask = slots[None, :] <= positions[0][:, None]  # [T, keys]: own history and itself
    cos, sin = target.rotary(positions)  # [1, T, hd]
    return target._stack(target.embed_tokens(ids), cos[:, None], sin[:, None], StaticStep(cache, positions[0], keys),
                         mask[None, None], want_taps, last_logits_only=False)


def drafter_block_static(drafter: Drafter, embed: torch.nn.Module, draft_head: torch.nn.Module,
                         context: ContextCache, ids: torch.Tensor, positions: torch.Tensor,
                         context_length: torch.Tensor, draft_ids: torch.Tensor | None, keys: int | None = None):
    """One stage over ids [1, k] at positions [k] against the context buffer's first `keys` slots (default
    all), of which the first `context_length` (0-d tensor) are live → drafts [k-1], log-probs [k-1],
    hidden [k, H]."""
    k, keys = ids.shape[1], keys or context.max_length
    live = torch.arange(keys, device=ids.device) < context_length  # [keys]
    visible = torch.cat([live, torch.ones(k, dtype=torch.bool, device=ids.device)])  # [keys + k]
    ctx_k, ctx_v = context.k[:, :, :, :keys], context.v[:, :, :, :keys]
    hidden = drafter(embed(ids), positions, ctx_k, ctx_v, visible[None, None, None, :])  # [1, k, H]
    logits = draft_head(hidden[0, 1:])  # [k-1, V] (or [k-1, Vd])
    best, drafts = logits.max(-1)
    logprobs = best - torch.logsumexp(logits, dim=-1)
    if draft_ids is not None:
        drafts = draft_ids[drafts]
    return drafts, logprobs, hidden[0]


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


class CudaGraphRunner:
    """Captured target-verify and drafter-block forwards of one TorchEngine, per bucket.

    Results follow the engine's contract: decision tensors (logits, drafts, log-probs) come back on
    the CPU, features (taps, hidden states) stay on the GPU."""

    def __init__(self, target: Target, cache: KVCache, drafter: Drafter | None = None,
                 context: ContextCache | None = None, draft_head: torch.nn.Module | None = None,
                 draft_ids: torch.Tensor | None = None, mask_token_id: int | None = None):
        self.device = target.embed_tokens.weight.device
        require_cuda(self.device)
        self.target, self.cache = target, cache
        self.drafter, self.context, self.draft_head, self.mask_token_id = drafter, context, draft_head, mask_token_id
        self.draft_ids = draft_ids.to(self.device) if draft_ids is not None else None
        self.graphs: dict[tuple, Captured] = {}

    # ---- target verify ---------------------------------------------------------------------------
    def verify_bucket(self, tokens: int) -> int | None:
        start = self.cache.length
        return next((b for b in BUCKETS if b >= tokens and start + b <= self.cache.max_length), None)

    def target_verify(self, input_ids: list[int], want_taps: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ logits [T, V] (CPU), taps [T, n*H] or None (GPU); advances the cache length by T."""
        T, start = len(input_ids), self.cache.length
        bucket = self.verify_bucket(T)
        if bucket is None:
            raise LoopspecError(f"no CUDA-graph bucket holds {T} tokens at length {start}")
        keys = key_bucket(start + bucket, self.cache.max_length)
        key = ("verify", 1, bucket, keys, want_taps)
        ids = torch.zeros(1, bucket, dtype=torch.long)  # padding: token 0, after the real tokens
        ids[0, :T] = torch.tensor(input_ids, dtype=torch.long)
        positions = torch.arange(start, start + bucket)[None]
        captured = self.graphs.get(key)
        if captured is None:
            inputs = {"ids": ids.to(self.device), "positions": positions.to(self.device)}
            captured = self.graphs[key] = capture(
                lambda: target_verify_static(self.target, self.cache, inputs["ids"], inputs["positions"], want_taps,
                                             keys),
                inputs)
        else:
            captured.inputs["ids"].copy_(ids)
            captured.inputs["positions"].copy_(positions)
        captured.graph.replay()
        self.cache.length = start + T
        logits, taps = captured.outputs
        return logits[0, :T].float().cpu(), (taps[0, :T].clone() if taps is not None else None)

    # ---- drafter block ---------------------------------------------------------------------------
    def drafter_block(self, anchor: int, position: int, block_size: int):
        """→ drafts [k-1] (CPU), log-probs [k-1] (CPU), final-norm hidden states [k, H] (GPU)."""
        keys = key_bucket(self.context.length, self.context.max_length)
        key = ("block", 1, block_size, keys)
        ids = torch.full((1, block_size), self.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        positions = torch.arange(position, position + block_size)
        length = torch.tensor(self.context.length, dtype=torch.long)
        captured = self.graphs.get(key)
        if captured is None:
            inputs = {"ids": ids.to(self.device), "positions": positions.to(self.device),
                      "length": length.to(self.device)}
            captured = self.graphs[key] = capture(
                lambda: drafter_block_static(self.drafter, self.target.embed_tokens, self.draft_head, self.context,
                                             inputs["ids"], inputs["positions"], inputs["length"], self.draft_ids,
                                             keys),
                inputs)
        else:
            captured.inputs["ids"].copy_(ids)
            captured.inputs["positions"].copy_(positions)
            captured.inputs["length"].copy_(length)
        captured.graph.replay()
        drafts, logprobs, hidden = captured.outputs
        return drafts.cpu(), logprobs.float().cpu(), hidden.clone()
