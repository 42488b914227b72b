"""PyTorch backend of the Engine protocol (engines/protocol.py): the reference modules run eagerly.

The engine owns the target's KV cache and the drafter's context cache, one `KVCache` each with
`max_rows` rows. The models may sit on a CUDA device: decision tensors (logits, drafts, log-probs)
come back on the CPU, features (taps, hidden states) stay on the device. With `cuda_graphs`,
verifications and stages of rows 0..R-1 (one request or a batch, chains or trees) replay captured
forwards (engines/cuda_graphs.py); prefill and calls no bucket holds run eagerly. An EAGLE-3
drafter (a chain kind) keeps its context in an `Eagle3Context` (engines/eagle3_context.py), which
also follows the target's tokens, and drafts its stages step by step (and EAGLE-2's dynamic trees,
`draft_dynamic`); it runs without CUDA graphs, as
does a DFlash2 drafter, whose stages end in its candidate selector's walk.
"""

from __future__ import annotations

import copy

import torch

from loopspec.errors import LoopspecError
from loopspec.decoding import DraftSampler
from loopspec.engines.eagle3_context import Eagle3Context
from loopspec.model.dflash2 import selector_stage
from loopspec.model.drafter import Drafter, StageDrafts, draft_head_weight, draft_stage, sample_stage
from loopspec.model.families import target_family
from loopspec.model.target import Target, inference_linear, pack_linears_for_cpu_
from loopspec.tree import DynamicTree


class TorchEngine:
    backend = "torch"
    chains_only = False
    samples_drafts = True  # `draft` can sample its drafts from the drafter's q and return q
    grows_dynamic_trees = True  # `draft_dynamic`, for a drafter kind that grows one
    tree_span = 0

    def __init__(self, target: Target, drafter: Drafter | None, max_context: int, num_threads: int | None = None,
                 cuda_graphs: bool = False, max_rows: int = 1):
        if num_threads:
            torch.set_num_threads(num_threads)
        if cuda_graphs and (target.cfg.experts is not None or target.cfg.linear_attention is not None
                            or "sliding_attention" in target.cfg.layer_types):
            raise LoopspecError(f"CUDA graphs replay fixed forwards over the whole cache; a {target.cfg.family} target "
                                "routes its tokens, steps a recurrent state or keeps a window ring on the host: "
                                "run it without --cuda-graphs")
        # an EAGLE-3 drafter drafts one token a step, from a context of its own (engines/eagle3_context.py)
        self.steps_drafts = drafter is not None and drafter.cfg.kind.chain
        if cuda_graphs and self.steps_drafts:
            raise LoopspecError(f"CUDA graphs replay block stages; an {drafter.cfg.kind.title} drafter drafts step "
                                "by step: run it without --cuda-graphs")
        # a DFlash2 drafter's drafts are its candidate selector's walk (loopspec/model/dflash2.py)
        self.selects = drafter is not None and drafter.cfg.kind.selector is not None
        if cuda_graphs and self.selects:
            raise LoopspecError(f"CUDA graphs capture DFlash's draft head, not a {drafter.cfg.kind.title} drafter's "
                                "candidate selector: run it without --cuda-graphs")
        # a recurrent state follows one path: draft trees are not verified on such a target (chains are)
        self.chains_only = not target_family(target.cfg.family).trees
        # inference copies of the weights prepacked for oneDNN (the modules are shared, not copied)
        self.target = pack_linears_for_cpu_(target.eval())
        self.drafter = pack_linears_for_cpu_(drafter.eval()) if drafter is not None else None
        self.target_cfg = target.cfg
        self.drafter_cfg = drafter.cfg if drafter is not None else None
        if drafter is not None:
            target.set_taps(drafter.cfg.target_layer_ids)
        limits = [max_context, target.cfg.max_position_embeddings]
        if drafter is not None:
            limits.append(drafter.cfg.max_position_embeddings)
        self.max_context = min(limits)
        self.device = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        self.precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        # a reduced draft vocabulary drafts over its rows of the target's lm_head only (cheaper stage);
        # an EAGLE-3 drafter has its own lm_head over its draft rows
        self.draft_ids = drafter.draft_ids.to(self.device) if drafter is not None and drafter.draft_ids is not None else None
        self.draft_head = (inference_linear(draft_head_weight(target.lm_head.weight, self.draft_ids))
                           if self.draft_ids is not None and not self.steps_drafts else self.target.lm_head)
        self.cuda_graphs = cuda_graphs
        self._new_caches(max_rows)

    def _new_caches(self, max_rows: int) -> None:
        if max_rows < 1:
            raise LoopspecError(f"max batch size must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.cache = self.target.new_cache(self.max_context, max_rows)
        if self.steps_drafts:
            embed = self.drafter.embed_tokens if self.drafter.embed_tokens is not None else self.target.embed_tokens
            self.context = Eagle3Context(self.drafter, embed, max_rows, self.max_context)
        else:
            self.context = self.drafter.new_context(self.max_context, max_rows) if self.drafter is not None else None
        self.graphs = self._static_runner() if self.cuda_graphs else None

    def _static_runner(self):
        """The bucketed static forwards the engine replays (engines/cuda_graphs.py): CUDA graphs."""
        from loopspec.engines.cuda_graphs import CudaGraphRunner

        return CudaGraphRunner(self)

    def with_rows(self, max_rows: int) -> "TorchEngine":
        twin = copy.copy(self)  # the same modules and draft head
        twin._new_caches(max_rows)
        return twin

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None

    # ---- target ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, row: int, prompt_ids: list[int], want_taps: bool, start: int = 0) -> torch.Tensor:
        self.cache.lengths[row] = start
        out = self.target(torch.tensor([prompt_ids], device=self.device), self.cache, want_taps=want_taps,
                          last_logits_only=True, first_row=row)
        if self.steps_drafts:
            self.context.wrote(row, start, prompt_ids)
        if want_taps and self.steps_drafts:
            self.context.restart(row, start)
            self.context.append([row], self.drafter.fuse(out.taps), [len(prompt_ids)])
        elif want_taps:
            self.context.lengths[row] = start
            self._append_context([row], self.drafter.features(out.taps), [len(prompt_ids)])
        return out.logits[0, -1].float().cpu()

    @torch.inference_mode()
    def verify(self, tokens: list[list[int]], want_taps: bool,
               tree_masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        want_taps = want_taps and self.has_drafter
        if self.graphs is not None:
            replayed = self.graphs.verify(tokens, want_taps, tree_masks)
            if replayed is not None:  # None: no bucket holds the call, which runs eagerly
                return replayed
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)  # right padding (never stored)
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = torch.tensor(t)
        counts = torch.tensor([len(t) for t in tokens])
        if self.steps_drafts:  # the tokens at the slots the target stores them in, for the drafter's entries
            for b, t in enumerate(tokens):
                self.context.wrote(b, int(self.cache.lengths[b]), t)
        out = self.target(ids.to(self.device), self.cache, want_taps=want_taps, counts=counts, tree_mask=tree_masks)
        return out.logits.float().cpu(), out.taps

    def target_rollback(self, lengths: list[int]) -> None:
        self.cache.rollback(lengths)

    def target_commit(self, starts: list[int], kept: list[list[int]]) -> None:
        self.cache.commit(starts, kept)
        if self.steps_drafts:
            self.context.commit(starts, kept)

    # ---- drafter context -------------------------------------------------------------------------
    @torch.inference_mode()
    def append_context(self, taps: torch.Tensor, counts: list[int]) -> None:
        if self.steps_drafts:
            self.context.append(list(range(taps.shape[0])), self.drafter.fuse(taps), counts)
            return
        self._append_context(list(range(taps.shape[0])), self.drafter.features(taps), counts)

    @torch.inference_mode()
    def append_pseudo_context(self, rows: list[int], hidden: torch.Tensor) -> None:
        if self.steps_drafts:  # the drafter's own states, as its later steps take them (no fc)
            self.context.append(rows, hidden, [hidden.shape[1]] * len(rows))
            return
        self._append_context(rows, hidden, [hidden.shape[1]] * len(rows))

    def _append_context(self, rows: list[int], features: torch.Tensor, counts: list[int]) -> None:
        # features [R, T, H] at each row's next positions (padding may run past the end: clamped, never stored)
        positions = self.context.lengths[rows][:, None] + torch.arange(features.shape[1])[None, :]  # [R, T]
        k, v = self.drafter.context_kv(features, positions.clamp_max(self.max_context - 1).to(self.device))
        self.context.append(k, v, rows, counts)

    def context_lengths(self, rows: list[int]) -> list[int]:
        return self.context.lengths[rows].tolist() if self.context is not None else [0] * len(rows)

    def context_rollback(self, rows: list[int], lengths: list[int]) -> None:
        self.context.rollback(lengths, rows)

    # ---- drafter ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, rows: list[int], anchors: list[int], positions: list[int], block_size: int,
              sampling: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # drafts sampled with each row's own CPU generator run eagerly: a captured graph cannot draw them
        if self.graphs is not None and sampling is None:
            replayed = self.graphs.draft(rows, anchors, positions, block_size)
            if replayed is not None:
                return replayed
        if self.steps_drafts:
            return self.context.draft(rows, anchors, positions, block_size, sampling, self.target_cfg.vocab_size)
        R, k = len(rows), block_size
        lengths = self.context.lengths[rows]  # [R]
        width = int(lengths.max())
        ctx_k, ctx_v = self.context.prefix(rows, width)
        mask = None
        if bool((lengths != width).any()):  # shorter contexts hide their stale slots; the block sees all
            seen = torch.arange(width + k)[None, :]
            mask = ((seen < lengths[:, None]) | (seen >= width))[:, None, None, :].to(self.device)  # [R, 1, 1, width + k]
        ids = torch.full((R, k), self.drafter_cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(anchors)
        pos = (torch.tensor(positions)[:, None, None] + torch.arange(k)).to(self.device)  # [R, 1, k]
        ids = ids.to(self.device)
        hidden = self.drafter(self.target.embed_tokens(ids), pos, ctx_k, ctx_v, mask)  # [R, k, H]
        if self.selects:
            return selector_stage(self.drafter, hidden, ids[:, 0], self.draft_head, sampling)
        if sampling is not None:
            sampler = DraftSampler(sampling, self.target_cfg.vocab_size, self.draft_ids)
            drafts, logq, confidence, q = sample_stage(self.drafter, hidden, ids[:, 0], self.draft_head,
                                                       self.draft_ids, sampler)
            return StageDrafts(drafts, logq, hidden, None if confidence is None else confidence.cpu(), q)
        drafts, logprobs, confidence = draft_stage(self.drafter, hidden, ids[:, 0], self.draft_head,
                                                   self.draft_ids)  # [R, D, C] each, [R, D]
        return StageDrafts(drafts.cpu(), logprobs.float().cpu(), hidden,
                           None if confidence is None else confidence.cpu())

    @torch.inference_mode()
    def draft_dynamic(self, rows: list[int], anchors: list[int], positions: list[int], top_k: int,
                      depth: int) -> list[DynamicTree]:
        if not (self.drafter is not None and self.drafter_cfg.kind.grows_dynamic_trees):
            raise LoopspecError("a dynamic draft tree needs a drafter that drafts step by step (EAGLE-3)")
        return self.context.draft_dynamic(rows, anchors, positions, top_k, depth)

    # ---- rows ------------------------------------------------------------------------------------
    def swap_rows(self, a: int, b: int) -> None:
        self.cache.swap_rows(a, b)
        if self.context is not None:
            self.context.swap_rows(a, b)
