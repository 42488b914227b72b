"""Pure sampling and acceptance functions, shared by every backend and method.

Conventions: `target_logits` has one row per verified position, row j predicting the token after the
j-th verified input (the anchor is input 0), so n drafts come with n + 1 target rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loopspec.errors import LoopspecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.temperature < math.inf:  # NaN and inf too: inf would sample uniformly
            raise LoopspecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LoopspecError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LoopspecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The post-temperature / top-k / top-p distribution over the last dim (fp32)."""
    logits = logits.float()
    # shifted by the max first, and the temperature kept above fp32's smallest normal number: a tiny
    # temperature then sends every other logit to -inf (the greedy limit) instead of to NaN
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each candidate
        drop = before >= params.top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # and always the most likely token (a top_p below fp32's resolution)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [..., V] → [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy argmax or a sample from the warped distribution of one row of logits [V]."""
    if params.greedy:
        return int(logits.argmax(-1))
    return int(sample(probabilities(logits, params), generator))


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of `drafts` [n] equal to the target's argmax; bonus = argmax at the first
    mismatch (or after the last draft). `target_logits`: [n + 1, V]. → (num_accepted, bonus)."""
    choice = target_logits.argmax(-1)  # [n + 1]
    n = drafts.shape[0]
    mismatch = (drafts != choice[:n]).nonzero()
    accepted = int(mismatch[0]) if mismatch.numel() else n
    return accepted, int(choice[accepted])


def speculative_accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling along a chain of drafts.

    drafts [n]; draft_probs [n, V] the distributions they were sampled from (None = argmax drafts,
    i.e. one-hot q); target_probs [n + 1, V]. Accept draft x with probability min(1, p(x)/q(x)); at the
    first rejection sample from normalize(max(0, p - q)); if all are accepted sample the bonus from
    p[n]. The committed tokens are then distributed exactly as samples from p. → (num_accepted, bonus)
    """
    n = drafts.shape[0]
    idx = torch.arange(n)
    p_x = target_probs[idx, drafts]  # [n]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs[idx, drafts]
    u = torch.rand(n, generator=generator, dtype=torch.float32)
    ok = u * q_x < p_x  # u < p/q without dividing by a zero q (u = 0 never accepts p = 0)
    rejected = (~ok).nonzero()
    accepted = int(rejected[0]) if rejected.numel() else n
    if accepted == n:
        return n, int(sample(target_probs[n], generator))
    p = target_probs[accepted]
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[drafts[accepted]] = 1.0
    else:
        q = draft_probs[accepted]
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q exactly: the rejection had probability 0; fall back to p
        residual, total = p, p.sum()
    return accepted, int(sample(residual / total, generator))
