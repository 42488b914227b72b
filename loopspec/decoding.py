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


def tree_accept(
    tree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
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


class DraftSampler:
    """Draws a stage's drafts from the drafter's own distribution q, one position at a time, each row
    with its own sampling parameters and generator (so a row's drafts never depend on the batch).

    `choose(logits)` takes one drafting position's logits [R, V or Vd] over the draft head's rows
    (the target's vocabulary, or the reduced draft vocabulary of `draft_ids`) → the chosen rows'
    indices [R] on the logits' device; it keeps each row's q, warped by that row's temperature /
    top-k / top-p and spread over the target's vocabulary (zero outside the draft rows), and the
    chosen token as a target id. A greedy row takes the argmax (its q one-hot there): greedy
    decoding drafts exactly as the argmax chain does."""

    def __init__(
        self, rows: list[tuple[SamplingParams, torch.Generator]], vocab_size: int, draft_ids: torch.Tensor | None
    ):
        self.rows, self.vocab_size = rows, vocab_size
        self.draft_ids = draft_ids.cpu() if draft_ids is not None else None
        self.tokens: list[torch.Tensor] = []  # per position [R] target ids
        self.q: list[torch.Tensor] = []  # per position [R, V]

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().cpu()  # the generators are CPU generators
        index = torch.empty(logits.shape[0], dtype=torch.long)
        q = torch.zeros(logits.shape[0], self.vocab_size)
        for r, (params, generator) in enumerate(self.rows):
            if params.greedy:
                index[r] = logits[r].argmax(-1)
                q_rows = torch.zeros(logits.shape[-1]).index_fill_(0, index[r : r + 1], 1.0)
            else:
                q_rows = probabilities(logits[r], params)
                index[r] = sample(q_rows, generator)
            if self.draft_ids is None:
                q[r] = q_rows
            else:
                q[r, self.draft_ids] = q_rows
        self.tokens.append(index if self.draft_ids is None else self.draft_ids[index])
        self.q.append(q)
        return index

    def drafts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What was drafted → the drafts [R, D, 1] (target ids; one candidate: the sampled one),
        their log q [R, D, 1] and q itself [R, D, V]."""
        tokens, q = torch.stack(self.tokens, dim=1), torch.stack(self.q, dim=1)
        return tokens[..., None], q.gather(-1, tokens[..., None]).log(), q


def speculative_accept(
    drafts: list[int],
    q: torch.Tensor,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling of a chain whose drafts were sampled from q → (how many drafts are
    accepted, the bonus token).

    q [n, V]: the distribution draft i was drawn from (given the drafts before it); target_logits
    [n + 1, V]: row i predicts the token after draft i - 1 (row 0: after the anchor). Draft x at
    position i is accepted with probability min(1, p(x) / q(x)), p the target's warped law there;
    at the first rejection the bonus is drawn from normalize(max(0, p - q)), and after n acceptances
    from p at row n. Each committed token is then distributed as p given its prefix (Leviathan et
    al., 2023), so the output is distributed as plain decoding's, and a position accepts with
    probability 1 - TV(p, q)."""
    p = probabilities(target_logits[: len(drafts) + 1], params)
    for i, x in enumerate(drafts):
        ratio = float(p[i, x]) / float(q[i, x])  # q(x) > 0: x was drawn from q
        if float(torch.rand((), generator=generator)) < ratio:
            continue
        residual = (p[i] - q[i].to(p.dtype)).clamp_min(0.0)
        # p(x) < q(x) puts mass q(x) - p(x) > 0 on the residual; only rounding can leave it empty
        # (p and q then agree to fp32's resolution, and p itself is the residual)
        return i, int(sample(residual / residual.sum() if float(residual.sum()) > 0 else p[i], generator))
    return len(drafts), int(sample(p[len(drafts)], generator))
