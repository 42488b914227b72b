"""PyTorch backend of the Engine protocol (engines/protocol.py): the reference modules run eagerly.

The engine owns the target's KV cache and the drafter's context (a `DrafterContext`, its
implementation looked up by the drafter's kind: engines/drafter_contexts.py), each with `max_rows`
rows. The models may sit on a CUDA device: decision tensors (logits, drafts, log-probs) come back
on the CPU, features (taps, hidden states) stay on the device. With `cuda_graphs`, verifications
and block stages of rows 0..R-1 (one request or a batch, chains or trees) replay captured forwards
(engines/cuda_graphs.py); prefill and calls no bucket holds run eagerly, as does every stage of a
drafter whose kind has no captured stage.
"""

from __future__ import annotations

import copy

import torch

from loopspec.engines.drafter_contexts import drafter_contexts
from loopspec.errors import LoopspecError
from loopspec.model.families import target_family
from loopspec.model.target import Target, pack_linears_for_cpu_
from loopspec.tree import DynamicTree


class TorchEngine:
    backend = "torch"
    chains_only = False
    samples_drafts = True  # `draft` can sample its drafts from the drafter's q and return q
    grows_dynamic_trees = True  # `draft_dynamic`, where the drafter's context grows one
    tree_span = 0
    block_types = ()  # the reference modules: no file's blocks

    def __init__(
        self,
        target: Target,
        drafter,
        max_context: int,
        num_threads: int | None = None,
        cuda_graphs: bool = False,
        max_rows: int = 1,
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        if cuda_graphs and (
            target.cfg.experts is not None
            or target.cfg.linear_attention is not None
            or "sliding_attention" in target.cfg.layer_types
        ):
            raise LoopspecError(
                f"CUDA graphs replay fixed forwards over the whole cache; a {target.cfg.family} target "
                "routes its tokens, steps a recurrent state or keeps a window ring on the host: "
                "run it without --cuda-graphs"
            )
        if cuda_graphs and drafter is not None and not drafter.cfg.kind.captured_stages:
            raise LoopspecError(
                f"CUDA graphs capture a block drafter's forward and draft head, not the stages of "
                f"{drafter.cfg.kind.title} drafters: run it without --cuda-graphs"
            )
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
        self.cuda_graphs = cuda_graphs
        if max_rows < 1:
            raise LoopspecError(f"max batch size must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.cache = self.target.new_cache(self.max_context, max_rows)
        self.context = (
            drafter_contexts(drafter.cfg.kind).torch(self.drafter, self.target, self.max_context, max_rows)
            if drafter is not None
            else None
        )
        self.graphs = self.static_runner() if self.cuda_graphs else None

    def static_runner(self):
        """The bucketed static forwards the engine replays (engines/cuda_graphs.py): CUDA graphs."""
        from loopspec.engines.cuda_graphs import CudaGraphRunner

        return CudaGraphRunner(self)

    def with_rows(self, max_rows: int) -> "TorchEngine":
        if max_rows < 1:
            raise LoopspecError(f"max batch size must be >= 1, got {max_rows}")
        twin = copy.copy(self)  # the same modules and drafter context's heads
        twin.max_rows = max_rows
        twin.cache = self.target.new_cache(self.max_context, max_rows)
        twin.context = self.context.with_rows(max_rows) if self.context is not None else None
        twin.graphs = twin.static_runner() if self.cuda_graphs else None
        return twin

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None

    # ---- target ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, row: int, prompt_ids: list[int], want_taps: bool, start: int = 0) -> torch.Tensor:
        self.cache.lengths[row] = start
        out = self.target(
            torch.tensor([prompt_ids], device=self.device),
            self.cache,
            want_taps=want_taps,
            last_logits_only=True,
            first_row=row,
        )
        if self.context is not None:
            self.context.target_wrote([row], [start], [prompt_ids])
            if want_taps:
                self.context.restart(row, start)
                self.context.append_taps([row], out.taps, [len(prompt_ids)])
        return out.logits[0, -1].float().cpu()

    @torch.inference_mode()
    def verify(
        self, tokens: list[list[int]], want_taps: bool, tree_masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        want_taps = want_taps and self.has_drafter
        if self.graphs is not None:
            replayed = self.graphs.verify(tokens, want_taps, tree_masks)
            if replayed is not None:  # None: no bucket holds the call, which runs eagerly
                return replayed
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)  # right padding (never stored)
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.tensor(t)
        counts = torch.tensor([len(t) for t in tokens])
        if self.context is not None:  # the tokens at the slots the target stores them in
            rows = list(range(len(tokens)))
            self.context.target_wrote(rows, self.cache.lengths[rows].tolist(), tokens)
        out = self.target(ids.to(self.device), self.cache, want_taps=want_taps, counts=counts, tree_mask=tree_masks)
        return out.logits.float().cpu(), out.taps

    def target_rollback(self, lengths: list[int]) -> None:
        self.cache.rollback(lengths)

    def target_commit(self, starts: list[int], kept: list[list[int]]) -> None:
        self.cache.commit(starts, kept)
        if self.context is not None:
            self.context.target_committed(starts, kept)

    # ---- drafter context -------------------------------------------------------------------------
    @torch.inference_mode()
    def append_context(self, taps: torch.Tensor, counts: list[int]) -> None:
        self.context.append_taps(list(range(taps.shape[0])), taps, counts)

    @torch.inference_mode()
    def append_pseudo_context(self, rows: list[int], hidden: torch.Tensor) -> None:
        self.context.append_pseudo(rows, hidden)

    def context_lengths(self, rows: list[int]) -> list[int]:
        return self.context.lengths[rows].tolist() if self.context is not None else [0] * len(rows)

    def context_rollback(self, rows: list[int], lengths: list[int]) -> None:
        self.context.rollback(rows, lengths)

    # ---- drafter ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ):
        # drafts sampled with each row's own CPU generator run eagerly: a captured graph cannot draw them
        if self.graphs is not None and sampling is None:
            replayed = self.graphs.draft(rows, anchors, positions, block_size)
            if replayed is not None:
                return replayed
        return self.context.draft(rows, anchors, positions, block_size, sampling)

    @torch.inference_mode()
    def draft_dynamic(
        self, rows: list[int], anchors: list[int], positions: list[int], top_k: int, depth: int
    ) -> list[DynamicTree]:
        if self.context is None:
            raise LoopspecError("a dynamic draft tree needs a drafter that drafts step by step (EAGLE-3)")
        return self.context.draft_dynamic(rows, anchors, positions, top_k, depth)

    # ---- rows ------------------------------------------------------------------------------------
    def swap_rows(self, a: int, b: int) -> None:
        self.cache.swap_rows(a, b)
        if self.context is not None:
            self.context.swap_rows(a, b)
