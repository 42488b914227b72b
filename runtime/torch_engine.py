"""PyTorch backend: the engines of the speculative loop run eagerly on the reference modules.

An engine owns the target's KV cache and the drafter's context cache (static buffers with lengths)
and exposes the four calls the loop makes; other backends (ONNX Runtime, TensorRT) expose the same.
The models may sit on a CUDA device: decision tensors (logits, drafts, log-probs) come back on the CPU,
features (taps, hidden states) stay on the device. `cuda_graphs` replays captured forwards there.
"""

from __future__ import annotations

import torch

from loopspec.model.drafter import Drafter
from loopspec.model.target import Target, inference_linear, pack_linears_for_cpu_


class TorchEngine:
    backend = "torch"

    def __init__(self, target: Target, drafter: Drafter | None, max_context: int, num_threads: int | None = None,
                 cuda_graphs: bool = False):
        # inference copies of the weights prepacked for oneDNN (the modules are shared, not copied)
        self.target = pack_linears_for_cpu_(target.eval())
        self.drafter = pack_linears_for_cpu_(drafter.eval()) if drafter is not None else None
        if num_threads:
            torch.set_num_threads(num_threads)
        if drafter is not None:
            target.set_taps(drafter.cfg.target_layer_ids)
        limits = [max_context, target.cfg.max_position_embeddings]
        if drafter is not None:
            limits.append(drafter.cfg.max_position_embeddings)
        self.max_context = min(limits)
        self.cache = target.new_cache(self.max_context)
        self.context = drafter.new_context(self.max_context) if drafter is not None else None
        self.block_size = drafter.cfg.block_size if drafter is not None else 1
        # a reduced draft vocabulary drafts over its rows of the target's lm_head only (cheaper stage)
        self.draft_ids = drafter.draft_ids if drafter is not None else None
        self.draft_head = (inference_linear(target.lm_head.weight[self.draft_ids]) if self.draft_ids is not None
                           else self.target.lm_head)
        self.mask_token_id = drafter.cfg.mask_token_id if drafter is not None else None
        self.drafter_cfg = drafter.cfg if drafter is not None else None
        self.vocab_size = target.cfg.vocab_size
        self.device = target.embed_tokens.weight.device
        self.graphs = None
        if cuda_graphs:
            from loopspec.runtime.cuda_graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(self.target, self.cache, self.drafter, self.context, self.draft_head,
                                          self.draft_ids, self.mask_token_id)

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None

    # ---- lifecycle -------------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache.length = 0
        if self.context is not None:
            self.context.length = 0

    @property
    def target_length(self) -> int:
        return self.cache.length

    @property
    def context_length(self) -> int:
        return self.context.length if self.context is not None else 0

    # ---- target_verify ---------------------------------------------------------------------------
    @torch.inference_mode()
    def target_verify(self, input_ids: list[int], all_logits: bool = True,
                      want_taps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens after the KV cache → logits [T, V] (or [1, V]) and taps [T, n*H] (None when
        not wanted or without a drafter)."""
        want_taps = want_taps and self.drafter is not None
        if self.graphs is not None and self.graphs.verify_bucket(len(input_ids)) is not None:
            logits, taps = self.graphs.target_verify(input_ids, want_taps)
            return (logits if all_logits else logits[-1:]), taps
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        out = self.target(ids, self.cache, want_taps=want_taps, last_logits_only=not all_logits)
        return out.logits[0].float().cpu(), (out.taps[0] if out.taps is not None else None)

    def target_rollback(self, length: int) -> None:
        self.cache.rollback(length)

    # ---- drafter_context -------------------------------------------------------------------------
    @torch.inference_mode()
    def drafter_context(self, taps: torch.Tensor) -> None:
        """Append the context features of taps [T, n*H] at the next positions."""
        start = self.context.length
        positions = torch.arange(start, start + taps.shape[0], device=self.device)
        k, v = self.drafter.context_kv(self.drafter.features(taps[None]), positions)
        self.context.append(k, v)

    @torch.inference_mode()
    def drafter_context_hidden(self, hidden: torch.Tensor) -> None:
        """Append H-dim pseudo-features [T, H] (the drafter's own hidden states) at the next positions."""
        start = self.context.length
        positions = torch.arange(start, start + hidden.shape[0], device=self.device)
        k, v = self.drafter.context_kv(hidden[None], positions)
        self.context.append(k, v)

    def context_rollback(self, length: int) -> None:
        self.context.rollback(length)

    # ---- drafter_block ---------------------------------------------------------------------------
    @torch.inference_mode()
    def drafter_block(self, anchor: int, position: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One stage on [anchor, MASK × (k-1)] at positions position .. position+k-1.

        → drafts [k-1] (argmax), their log-probs [k-1], final-norm hidden states [k, H]."""
        if self.graphs is not None:
            return self.graphs.drafter_block(anchor, position, block_size)
        k = block_size
        ids = torch.full((1, k), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = anchor
        positions = torch.arange(position, position + k, device=self.device)
        n = self.context.length
        hidden = self.drafter(self.target.embed_tokens(ids), positions,
                              self.context.k[:, :, :, :n], self.context.v[:, :, :, :n])  # [1, k, H]
        logits = self.draft_head(hidden[0, 1:])  # [k-1, V] (or [k-1, Vd])
        best, drafts = logits.max(-1)
        logprobs = best - torch.logsumexp(logits, dim=-1)
        drafts, logprobs = drafts.cpu(), logprobs.float().cpu()
        if self.draft_ids is not None:
            drafts = self.draft_ids[drafts]
        return drafts, logprobs, hidden[0]
