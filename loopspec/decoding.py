"""Pure sampling and acceptance functions, shared by every backend and method.

Conventions: `target_logits` has one row per verified node, row j predicting the token after node j
(the anchor is node 0), so n drafted nodes come with n + 1 target rows.
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


def tree_accept(tree, target_logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Walk a draft tree (loopspec.tree.DraftTree) from its root → (the accepted path as node indices,
    starting with the anchor's 0; the bonus token).

    target_logits [T, V]: row i predicts the token after node i. At each node the target's next token
    is drawn exactly as plain decoding draws it (`next_token`: the argmax under greedy, else a sample
    of p after temperature / top-k / top-p); the walk follows the child carrying that token, and the
    first token no child carries is the bonus. Every committed token is thus drawn from p given its
    prefix, so the output is distributed as plain decoding's, and identical to it under greedy,
    wherever the nodes came from. A chain is the tree with one child per node; with argmax drafts
    this is speculative sampling with a one-hot q (accept d with probability p(d), else draw from
    p without d)."""
    node, path = 0, [0]
    while True:
        token = next_token(target_logits[node], params, generator)
        child = tree.child(node, token)
        if child is None:
            return path, token
        path.append(child)
        node = child
