"""DSpark: a DFlash drafter with two small heads on the final-norm states h_i (`draft_stage` runs them).

- a low-rank Markov head that corrects each position's logits by the token before it,
  z_i = lm_head(h_i) + W2·u_i, left to right, where prev_0 is the anchor and prev_{i+1} the argmax of
  z_i; u_i = W1[prev_i] (vanilla), σ(gate([h_i ; W1[prev_i]])) ⊙ W1[prev_i] (gated), or a GRU-like
  state s_i over joint([s_{i-1} ; W1[prev_i] ; h_i]) → (g, c, o) with u_i = tanh(o) (rnn);
- a confidence head σ(proj([h_i ; W1[prev_i]])) (or of h_i alone): the estimated probability that
  draft i is accepted given that the drafts before it were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loopspec.errors import LoopspecError
from loopspec.model.drafter_kinds import MARKOV_HEAD_TYPES


@dataclass(frozen=True)
class DSparkHeads:
    """The DSpark heads a drafter is given for training: a Markov head of `markov_rank` (0: none) and
    `markov_head_type` (None: vanilla; a type is refused without a rank), and a confidence head
    (reading W1[prev] too when there is a Markov head)."""

    markov_rank: int = 0
    markov_head_type: str | None = None
    confidence_head: bool = False

    def __post_init__(self):
        if self.markov_head_type is not None and not self.markov_rank:
            raise LoopspecError(
                f"a {self.markov_head_type} Markov head (--markov-head) needs its rank: give --markov-rank"
            )
        if self.markov_head_type is None:
            object.__setattr__(self, "markov_head_type", "vanilla")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise LoopspecError(
                f"unknown Markov head type {self.markov_head_type!r} (choose from {', '.join(MARKOV_HEAD_TYPES)})"
            )
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise LoopspecError(f"Markov rank must be an integer >= 0, got {self.markov_rank!r}")
        if not (self.markov_rank or self.confidence_head):
            raise LoopspecError("a DSpark drafter needs a Markov head (rank > 0) or a confidence head")


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov correction: a bias W2·u over the vocabulary from the token before a
    position (`markov_w1`, an embedding [V, r]), gated by the position's state or carried through a
    recurrent state (see the module docstring). Parameter names are DeepSpec's."""

    def __init__(self, cfg):  # a block drafter's DrafterConfig (model/dflash.py imports this module)
        super().__init__()
        r, H = cfg.markov_rank, cfg.hidden_size
        self.head_type = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)  # rows: gate | candidate | output

    def latent(
        self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: previous tokens prev [R] (target ids) and final-norm states h [R, H] → the
        rank-r latent u [R, r] whose W2 product is the bias, and the recurrent state after it (rnn)."""
        e = self.markov_w1(prev).to(h.dtype)  # [R, r]
        if self.head_type == "vanilla":
            return e, state
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e, state
        if state is None:  # the state starts at zero at every block's first drafting position
            state = torch.zeros_like(e)
        gate, candidate, output = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)  # [R, r] each
        gate = torch.sigmoid(gate)
        return torch.tanh(output), gate * state + (1 - gate) * torch.tanh(candidate)


class ConfidenceHead(nn.Module):
    """DSpark's per-position acceptance estimate σ(proj(features)), features [h ; W1[prev]] or h."""

    def __init__(self, cfg):  # a block drafter's DrafterConfig (model/dflash.py imports this module)
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0), 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features).squeeze(-1).float())


class DraftHeads(nn.Module):
    """What `draft_stage` reads of a drafter — its config, Markov head and confidence head — as plain
    modules: the torch engine swaps a drafter's Linears for oneDNN-packed copies in place, whose
    product does not export, so the export runs fresh heads holding the same weights."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.cfg = drafter.cfg
        self.markov_head = self.confidence_head = None
        for name, make in (("markov_head", MarkovHead), ("confidence_head", ConfidenceHead)):
            head = getattr(drafter, name)
            if head is not None:
                plain = make(drafter.cfg)  # fp32, as every exported graph
                plain.load_state_dict(head.state_dict())
                setattr(self, name, plain.eval())
