"""CUDA graphs for the torch backend: the target-verify and drafter-block forwards are captured once per
(batch, length) bucket over static buffers and replayed with padding.

A CUDA graph replays fixed kernels on fixed addresses, so nothing inside it may depend on a Python
int that changes between calls (the cache length, the context length). The captured forwards
therefore take positions and lengths as tensors and see a fixed-size window of the static buffer,
the first `keys` slots (a power of two >= what the call needs, so attention costs at most twice
the live length):
- target verify: T real tokens (a chain or a draft tree) are padded to the bucket length with a
  chain that continues after them. Slots, positions and the attention mask over the window are
  input buffers, built on the host by the eager forward's own rule (`attention_mask`): a real query
  never sees a padding key nor a stale slot past the cache length; the padding's K/V land in slots
  past the new length, which the next forward overwrites before any query can see them. Outputs
  are sliced to the real tokens.
- drafter block: the block attends to the context window with the mask `context slot < context
  length` (a tensor) plus the whole block (bidirectional).
Calls that fit no bucket (a long prefill, the last slots of the context) run eagerly.

Graphs cover one-row calls on row 0 (a single request); the bucket key carries the row count so
batched buckets can be added. Calls over several rows run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loopspec.errors import LoopspecError
from loopspec.model.drafter import Drafter, draft_candidates
from loopspec.model.target import KVCache, KVWrite, Target, TargetOutput, attention_mask

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


def target_verify_static(target: Target, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor,
                         slots: torch.Tensor, mask: torch.Tensor, want_taps: bool) -> TargetOutput:
    """The target over ids/positions [1, T] in row 0 of `cache` with static shapes (its length is
    neither read nor moved): token t's K/V land at slot slots[t], and it sees the slots `mask` [T, keys]
    marks among the first `keys` (attention_mask: the committed history, and its chain or tree
    ancestors among the new tokens).

    Row t equals the eager forward's row t whenever slots continue the cache (start .. start+T-1) and
    positions/mask are the eager forward's."""
    cos, sin = target.rotary(positions)  # [1, T, hd]
    write = KVWrite(slice(0, 1), mask.shape[-1], slots=slots)
    return target._stack(target.embed_tokens(ids), cos[:, None], sin[:, None], cache, write, mask[None, None],
                         want_taps, None)


def drafter_block_static(drafter: Drafter, embed: torch.nn.Module, draft_head: torch.nn.Module,
                         context: KVCache, ids: torch.Tensor, positions: torch.Tensor,
                         context_length: torch.Tensor, draft_ids: torch.Tensor | None, keys: int | None = None):
    """One stage over ids [1, k] at positions [k] against row 0 of the context buffer, its first `keys`
    slots (default all), of which the first `context_length` (0-d tensor) are live → drafts [k-1, C],
    log-probs [k-1, C], hidden [k, H]."""
    k, keys = ids.shape[1], keys or context.max_length
    live = torch.arange(keys, device=ids.device) < context_length  # [keys]
    visible = torch.cat([live, torch.ones(k, dtype=torch.bool, device=ids.device)])  # [keys + k]
    ctx_k, ctx_v = context.k[:, :1, :, :keys], context.v[:, :1, :, :keys]
    hidden = drafter(embed(ids), positions, ctx_k, ctx_v, visible[None, None, None, :])  # [1, k, H]
    drafts, logprobs = draft_candidates(draft_head(hidden[0, 1:]), draft_ids)  # [k-1, C] each
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
    """Captured target-verify and drafter-block forwards of row 0 of a TorchEngine's caches, per bucket.

    Results follow the engine's contract: decision tensors (logits, drafts, log-probs) come back on
    the CPU, features (taps, hidden states) stay on the GPU."""

    def __init__(self, engine):
        self.device = engine.device
        require_cuda(self.device)
        self.target, self.cache = engine.target, engine.cache
        self.drafter, self.context, self.draft_head = engine.drafter, engine.context, engine.draft_head
        self.mask_token_id = engine.drafter_cfg.mask_token_id if engine.drafter_cfg is not None else None
        self.draft_ids = engine.draft_ids
        self.graphs: dict[tuple, Captured] = {}

    # ---- target verify ---------------------------------------------------------------------------
    def verify_bucket(self, tokens: int) -> int | None:
        start = int(self.cache.lengths[0])
        return next((b for b in BUCKETS if b >= tokens and start + b <= self.cache.max_length), None)

    def verify(self, input_ids: list[int], want_taps: bool,
               tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ logits [T, V] (CPU), taps [T, n*H] or None (GPU); advances row 0's length by T. The
        tokens are a chain, or a draft tree with `tree_mask` [T, T] (its ancestor mask)."""
        T, start = len(input_ids), int(self.cache.lengths[0])
        bucket = self.verify_bucket(T)
        if bucket is None:
            raise LoopspecError(f"no CUDA-graph bucket holds {T} tokens at length {start}")
        keys = key_bucket(start + bucket, self.cache.max_length)
        key = ("verify", 1, bucket, keys, want_taps)
        ids = torch.zeros(1, bucket, dtype=torch.long)  # padding: token 0, after the real tokens
        ids[0, :T] = torch.tensor(input_ids, dtype=torch.long)
        # padding tokens continue the chain after the real ones: no real token sees them, and their
        # K/V land past the new length, where the next forward writes before anyone reads
        tree = torch.ones(bucket, bucket, dtype=torch.bool).tril()
        if tree_mask is not None:
            tree[:T, :T] = tree_mask
        positions = start + tree.sum(-1)[None] - 1  # [1, bucket]
        slots = torch.arange(start, start + bucket)
        mask = attention_mask(torch.tensor([start]), bucket, keys, tree[None])[0]  # [bucket, keys]
        captured = self.graphs.get(key)
        values = {"ids": ids, "positions": positions, "slots": slots, "mask": mask}
        if captured is None:
            inputs = {name: t.to(self.device) for name, t in values.items()}
            captured = self.graphs[key] = capture(
                lambda: target_verify_static(self.target, self.cache, inputs["ids"], inputs["positions"],
                                             inputs["slots"], inputs["mask"], want_taps),
                inputs)
        else:
            for name, t in values.items():
                captured.inputs[name].copy_(t)
        captured.graph.replay()
        self.cache.lengths[0] = start + T
        logits, taps = captured.outputs
        return logits[0, :T].float().cpu(), (taps[0, :T].clone() if taps is not None else None)

    # ---- drafter block ---------------------------------------------------------------------------
    def draft(self, anchor: int, position: int, block_size: int):
        """→ drafts [k-1] (CPU), log-probs [k-1] (CPU), final-norm hidden states [k, H] (GPU)."""
        length = int(self.context.lengths[0])
        keys = key_bucket(length, self.context.max_length)
        key = ("block", 1, block_size, keys)
        ids = torch.full((1, block_size), self.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        positions = torch.arange(position, position + block_size)
        length = torch.tensor(length, dtype=torch.long)
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
