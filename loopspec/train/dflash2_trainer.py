"""DFlash2 drafter training (`loopspec train --family dflash2`, docs/training.md).

The loss is DFlash's (loopspec/train/trainer.py: anchors, the block [x_a, MASK × (B-1)] over the
context before its anchor, cross-entropy at block positions 1..B-1 weighted exp(-d/γ)) on the unary
logits the selector reads (the target head's, times output_multiplier, soft-capped), plus the
candidate selector's own cross-entropy: at every drafting slot, the slot's top-k unary candidates
are scored as the walk scores them, unary[c] + ⟨predecessor_codebook[p] ⊙ u, successor_codebook[c]⟩,
with the data's token before the slot as the predecessor p (teacher forcing: within an accepted run
the walk's own token is the data's), and a softmax over those k scores is trained toward the data's
token. A slot whose data token is not among its candidates adds no selector loss (the walk could not
draft it); the share of slots that do is logged as `selector_coverage`. Both terms share the slot's
weight exp(-d/γ) and DFlash's normaliser (the weights' sum). This is SpecForge's DFlash2 objective
(selector weight 1, no stop-gradient: the selector's loss reaches the backbone through the unary
logits and u) and vLLM speculators' (an alpha-weighted k-way CE over the unary top-k), without the
candidate set's gold-token insertion some of them offer: loopspec trains the strict top-k.

Each anchor's block runs as its own row (the convolutions run along one block: a packed sequence of
blocks would convolve one block's slots into the next), exactly as the torch engine drafts it; the
held-out τ runs the selector's walk (`selector_stage`, what inference drafts).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from loopspec.errors import LoopspecError
from loopspec.model.dflash2 import DFlash2Drafter, selector_stage
from loopspec.model.target import Target
from loopspec.train.trainer import DraftVocab, DrafterTrainer, TrainConfig, sample_anchors

SELECTOR_WEIGHT = 1.0  # the selector's cross-entropy beside the block's (SpecForge's default alpha)


def selector_scores(
    drafter: DFlash2Drafter, states: torch.Tensor, unary_logits: torch.Tensor, previous: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every drafting slot at once, each after a given predecessor: states [..., H] (final-norm states
    of the slots), their unary logits [..., V], previous [...] (the token before each slot) →
    (scores [..., K] of the slot's top-K unary candidates, those candidates [..., K]) — what the walk
    scores at a slot whose chosen predecessor is `previous`."""
    selector = drafter.candidate_selector
    unary, candidates = unary_logits.topk(drafter.cfg.selector_top_k, dim=-1)  # [..., K], descending
    projected = selector.hidden_projection(states)  # [..., rank]
    K, rank = candidates.shape[-1], projected.shape[-1]
    edges = selector.edges(previous.reshape(-1), projected.reshape(-1, rank), candidates.reshape(-1, K))  # [R, K]
    return unary + edges.view_as(unary).to(unary.dtype), candidates


class DFlash2Trainer(DrafterTrainer):
    """DFlash's block loss on the unary logits plus the selector's (module docstring), with the calls
    `train_drafter` makes of a trainer."""

    def __init__(
        self, target: Target, drafter: DFlash2Drafter, cfg: TrainConfig, draft_vocab: DraftVocab | None = None
    ):
        if draft_vocab is not None:
            raise LoopspecError(
                "a DFlash2 drafter's selector ranks the target head's top-k over the whole "
                "vocabulary: a reduced draft vocabulary does not apply to it"
            )
        super().__init__(target, drafter, cfg, None)

    def stage(
        self, tokens: torch.Tensor, anchors: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block per anchor, each a row over the context before its anchor (ctx_k/v [N, 1, kvh, C, hd]
        of positions 0..C-1), as the torch engine drafts → (positions [n, B], final-norm hidden [n, B, H])."""
        B, n, C = self.drafter.cfg.block_size, anchors.numel(), ctx_k.shape[3]
        positions = anchors[:, None] + torch.arange(B)[None]  # [n, B]
        ids = torch.full((n, B), self.drafter.cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = tokens[anchors]
        with torch.no_grad():
            embeds = self.target.embed_tokens(ids)  # [n, B, H]
        slots = torch.arange(C + B)[None]
        mask = ((slots < anchors[:, None]) | (slots >= C))[:, None, None]  # [n, 1, 1, C + B]: its context, its block
        hidden = self.drafter(
            embeds, positions[:, None], ctx_k.expand(-1, n, -1, -1, -1), ctx_v.expand(-1, n, -1, -1, -1), mask
        )  # [n, B, H]
        return positions, hidden

    def _chunk_loss(self, tokens, loss_mask, anchors, ctx_k, ctx_v, target_logits):
        positions, hidden = self.stage(tokens, anchors, ctx_k, ctx_v)
        keep = torch.ones(anchors.numel(), dtype=torch.bool)
        return self._labelled_rows(hidden, tokens, loss_mask, positions, keep, target_logits)

    def _draft_logits(self, hidden: torch.Tensor, latent: torch.Tensor | None) -> torch.Tensor:
        """The unary logits: the head's, scaled and soft-capped as the selector reads them."""
        return self.drafter.unary_logits(super()._draft_logits(hidden, latent))

    def _row_extra_loss(self, hidden, logits, labels, prev, weights) -> tuple[torch.Tensor, dict]:
        """The selector's cross-entropy over each labelled slot's candidates, teacher-forced (module
        docstring) → (Σ weight · CE over the covered slots, stats)."""
        scores, candidates = selector_scores(self.drafter, hidden, logits, prev)  # [R, K] each
        hit = candidates == labels[:, None]  # [R, K]: at most one candidate is the data's token
        covered = hit.any(-1)  # [R]
        ce = F.cross_entropy(scores[covered].float(), hit[covered].long().argmax(-1), reduction="none")
        picked = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]  # the walk's pick after the data's token
        stats = {
            "selector_slots": int(labels.numel()),
            "selector_covered": int(covered.sum()),
            "selector_correct": int((picked == labels).sum()),
        }
        return SELECTOR_WEIGHT * (weights[covered] * ce).sum(), stats

    def loop_sequence_loss(self, *args, **kwargs):
        # TrainConfig refuses --loop-stages with --family dflash2; this guards a direct call
        raise LoopspecError("loop-aware training of DFlash2 drafters is not implemented")

    @torch.no_grad()
    def expected_tau(
        self,
        tokens: torch.Tensor,
        loss_mask: torch.Tensor,
        taps: torch.Tensor,
        max_anchors: int = 64,
        top_ks: tuple[int, ...] = (),
    ) -> tuple[dict, int]:
        """Held-out acceptance over anchors of one sequence, drafted by the selector's walk as inference
        drafts it → ({"tau": Σ 1 + the leading drafts equal to the data's tokens, k: the same where the
        data's token is among the slot's k best candidates scored after the walk's token}, anchors)."""
        L = tokens.numel()
        anchors = sample_anchors(loss_mask, max_anchors, random.Random(0))
        if anchors.numel() == 0:
            return {"tau": 0.0, **{k: 0.0 for k in top_ks}}, 0
        features = self.drafter.features(taps[None, : L - 1].to(self.drafter.fc.weight.dtype))
        ctx_k, ctx_v = self.drafter.context_kv(features, torch.arange(L - 1))
        positions, hidden = self.stage(tokens, anchors, ctx_k, ctx_v)
        drafts = selector_stage(self.drafter, hidden, tokens[anchors], self.target.lm_head)[0]  # [n, D, C]
        drafted = positions[:, self.first :]  # [n, D] the position each slot drafts
        labels = tokens[drafted.clamp(max=L - 1)]
        counted = (drafted < L) & loss_mask[drafted.clamp(max=L - 1)]

        def accepted(good: torch.Tensor) -> float:  # good [n, D] → Σ over anchors of 1 + leading run
            return float((torch.cumprod((good & counted).long(), dim=1).sum(1) + 1).sum())

        sums = {"tau": accepted(drafts[..., 0] == labels)}
        for k in top_ks:
            sums[k] = accepted((drafts[..., :k] == labels[..., None]).any(-1))
        return sums, anchors.numel()
