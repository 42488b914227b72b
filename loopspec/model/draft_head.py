"""The draft-head step of one stage: a block's final-norm states → each drafting position's ranked
drafts and their log-probabilities, through the target's lm_head (its draft rows) and, for a DSpark
drafter (loopspec/model/dspark.py), its Markov correction and confidence estimates. Written in plain
ops, so that the exported drafter graph runs exactly this too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from torch import nn

if TYPE_CHECKING:  # annotations only
    from loopspec.tree import Lattice


def draft_head_weight(lm_head_weight: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The rows of the target's lm_head a drafter drafts over: all of them, or its reduced draft
    vocabulary's (target ids `draft_ids`, the d2t map) → [V or Vd, H]."""
    return lm_head_weight if draft_ids is None else lm_head_weight[draft_ids]


DRAFT_CANDIDATES = 8  # ranked candidates the draft head returns per block position (draft trees branch over them)


def draft_candidates(
    logits: torch.Tensor, draft_ids: torch.Tensor | None, top_k: int = DRAFT_CANDIDATES
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft-head step: logits [..., V or Vd] over the draft head's rows → each position's `top_k`
    best drafts, rank-ordered, as target ids, and their log-probabilities, both [..., top_k]; rank 0
    is the argmax (the chain). Written in plain ops so that the exported drafter graph runs exactly
    this too."""
    best, index = logits.topk(min(top_k, logits.shape[-1]), dim=-1)  # [..., K] descending
    top = best[..., :1]
    logprobs = best - top - torch.log(torch.exp(logits - top).sum(-1, keepdim=True))  # log softmax at each
    return (draft_ids[index] if draft_ids is not None else index), logprobs


class StageDrafts(tuple):
    """What an engine's `draft` returns: the tuple (drafts [R, D, C], log-probs [R, D, C], hidden
    [R, k, H]) of the Engine protocol, which callers unpack as three, and the confidence head's
    per-position estimates [R, D] as `.confidence` (None without a confidence head); with drafts
    sampled from the drafter (`sample_stage`), the distribution q [R, D, V] each was drawn from as
    `.q` (None otherwise); a DFlash2 drafter's argmax stage carries its selector's lattice over the
    rows' slots as `.lattice` (loopspec.tree.Lattice; None otherwise)."""

    confidence: torch.Tensor | None
    q: torch.Tensor | None
    lattice: "Lattice | None"

    def __new__(
        cls,
        drafts: torch.Tensor,
        logprobs: torch.Tensor,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        q: torch.Tensor | None = None,
        lattice=None,
    ):
        out = super().__new__(cls, (drafts, logprobs, hidden))
        out.confidence, out.q, out.lattice = confidence, q, lattice
        return out


def draft_stage(
    drafter: nn.Module,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    head,
    draft_ids: torch.Tensor | None,
    top_k: int = DRAFT_CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The draft-head step of one stage: the final-norm states of blocks hidden [R, k, H] whose
    anchors are `anchors` [R] → each drafting position's `top_k` candidates [R, D, C] (target ids,
    rank 0 the argmax chain), their log-probabilities [R, D, C], and the confidence head's estimates
    [R, D] (None without one). D is k-1 or k, by the drafter's block convention. `head` maps states
    [..., H] to logits over the draft rows [..., V or Vd] (the target's lm_head, or its draft rows).

    A DSpark head runs left to right: position i's logits are corrected by the token before it —
    the anchor at the first drafting position, then the previous position's corrected argmax — so
    the chain is the greedy Markov chain and a tree's other ranks come from the same corrected
    logits. Written in plain ops, as `draft_candidates`."""
    cfg = drafter.cfg
    h = hidden[:, cfg.first_draft :]  # [R, D, H]
    logits = head(h)  # [R, D, V or Vd]
    if not cfg.is_dspark:
        drafts, logprobs = draft_candidates(logits, draft_ids, top_k)
        return drafts, logprobs, None
    corrected, prevs = corrected_logits(drafter, h, logits, anchors, draft_ids, lambda z: z.argmax(-1))
    drafts, logprobs = draft_candidates(corrected, draft_ids, top_k)  # [R, D, C] each
    return drafts, logprobs, stage_confidence(drafter, h, prevs)


def sample_stage(
    drafter: nn.Module, hidden: torch.Tensor, anchors: torch.Tensor, head, draft_ids: torch.Tensor | None, sampler
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The draft-head step of one stage with drafts sampled from the drafter's distribution q
    (`sampler`: a loopspec.decoding.DraftSampler over the stage's rows) instead of its argmax →
    the drafts [R, D, 1] (target ids), their log q [R, D, 1], the confidence head's estimates [R, D]
    (or None) and q [R, D, V] over the target's vocabulary (on the CPU). A DSpark drafter's q at
    position i is its Markov-corrected distribution given the token sampled at i - 1."""
    h = hidden[:, drafter.cfg.first_draft :]  # [R, D, H]
    _, prevs = corrected_logits(drafter, h, head(h), anchors, draft_ids, sampler.choose)
    drafts, logq, q = sampler.drafts()
    return drafts, logq, stage_confidence(drafter, h, prevs), q


def corrected_logits(
    drafter: nn.Module,
    h: torch.Tensor,
    logits: torch.Tensor,
    anchors: torch.Tensor,
    draft_ids: torch.Tensor | None,
    choose,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left to right over the drafting positions' states h [R, D, H] and logits [R, D, V or Vd]:
    each position's logits plus the Markov head's bias from the token before it (none without a
    Markov head), and the token `choose(corrected logits [R, V or Vd])` picks there (a draft-row
    index [R]) as the next position's predecessor → corrected logits [R, D, V or Vd] and each
    position's predecessor [R, D] (target ids; the anchor first)."""
    markov = drafter.markov_head
    w2 = None
    if markov is not None and draft_ids is not None:  # the bias over the draft rows only
        w2 = draft_head_weight(markov.markov_w2.weight, draft_ids)  # [Vd, r]
    prev, state = anchors, None  # [R]
    prevs, corrected = [], []
    for i in range(h.shape[1]):
        prevs.append(prev)
        z = logits[:, i]  # [R, V or Vd]
        if markov is not None:
            u, state = markov.latent(prev, h[:, i], state)  # [R, r]
            z = z + (markov.markov_w2(u) if w2 is None else F.linear(u, w2)).to(z.dtype)
        corrected.append(z)
        chosen = choose(z).to(z.device)  # [R]: the draft here is the next position's predecessor
        prev = draft_ids[chosen] if draft_ids is not None else chosen
    return torch.stack(corrected, dim=1), torch.stack(prevs, dim=1)


def stage_confidence(drafter: nn.Module, h: torch.Tensor, prevs: torch.Tensor) -> torch.Tensor | None:
    """The confidence head's estimates [R, D] at states h [R, D, H] with predecessors prevs [R, D]
    (None without a confidence head)."""
    if drafter.confidence_head is None:
        return None
    return drafter.confidence_head(confidence_features(drafter, h, prevs))  # [R, D]


def confidence_logits(drafter: nn.Module, h: torch.Tensor, prevs: torch.Tensor) -> torch.Tensor | None:
    """The confidence head's logits (before the sigmoid) at states h [..., H] with predecessors
    prevs [...] (None without a confidence head): what training's cross-entropy reads."""
    if drafter.confidence_head is None:
        return None
    return drafter.confidence_head.proj(confidence_features(drafter, h, prevs)).squeeze(-1).float()


def confidence_features(drafter: nn.Module, h: torch.Tensor, prevs: torch.Tensor) -> torch.Tensor:
    """What the confidence head reads: [h ; W1[prev]] (with the Markov head's embedding) or h."""
    if drafter.cfg.confidence_with_markov:
        return torch.cat([h, drafter.markov_head.markov_w1(prevs).to(h.dtype)], dim=-1)  # [..., H + r]
    return h
