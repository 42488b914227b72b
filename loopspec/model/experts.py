"""Mixture-of-experts feed-forward of the MoE target families (Qwen3-MoE, gpt-oss, Qwen3.5-MoE, Qwen3-Next).

A router scores every expert per token; each token runs its top-k experts (SwiGLU each) and sums
their outputs weighted by the routing probabilities; Qwen3.5-MoE and Qwen3-Next add a shared expert
every token runs, scaled by a sigmoid gate of its own. Routing is per token: a row's tokens pick the same
experts alone or batched, and only the tokens routed to an expert run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.errors import LoopspecError

ROUTINGS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertsConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's SwiGLU width
    sparse_layers: tuple[int, ...]  # layers whose feed-forward is the experts; the others are dense SwiGLU
    routing: str = "softmax_topk"  # Qwen3-MoE: softmax over all, then top-k | gpt-oss: top-k logits, then softmax
    norm_topk_prob: bool = False  # softmax_topk: the k probabilities renormalised to sum 1
    bias: bool = False  # gpt-oss: router and experts carry biases
    activation: str = "swiglu"  # silu(gate) * up | gpt-oss: clamped, (up + 1) * gate * sigmoid(1.702 gate)
    swiglu_limit: float = 7.0  # clamped_swiglu: gate <= limit, |up| <= limit
    # Qwen3.5-MoE, Qwen3-Next: a shared SwiGLU of this width, × sigmoid(shared gate); 0: none
    shared_intermediate_size: int = 0

    def __post_init__(self):
        if self.routing not in ROUTINGS or self.activation not in ACTIVATIONS:
            raise LoopspecError(f"unknown experts routing {self.routing!r} or activation {self.activation!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise LoopspecError(f"experts per token ({self.top_k}) must be in 1..{self.num_experts} (the experts)")


class SparseExperts(nn.Module):
    """The experts of one layer: `router` [E, H] (+ bias), `gate_up` [E, 2I, H] (gate rows first),
    `down` [E, H, I], and with `bias` gate_up_bias [E, 2I], down_bias [E, H]; with a shared expert
    `shared_gate_up` [2Is, H], `shared_down` [H, Is] and `shared_gate` [1, H]."""

    def __init__(self, hidden: int, cfg: ExpertsConfig):
        super().__init__()
        E, I = cfg.num_experts, cfg.intermediate_size
        self.cfg = cfg
        self.router = nn.Linear(hidden, E, bias=cfg.bias)
        self.gate_up = nn.Parameter(torch.zeros(E, 2 * I, hidden))
        self.down = nn.Parameter(torch.zeros(E, hidden, I))
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * I)) if cfg.bias else None
        self.down_bias = nn.Parameter(torch.zeros(E, hidden)) if cfg.bias else None
        shared = cfg.shared_intermediate_size
        self.shared_gate_up = nn.Linear(hidden, 2 * shared, bias=False) if shared else None
        self.shared_down = nn.Linear(shared, hidden, bias=False) if shared else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] → each token's experts [N, k] and their weights [N, k]."""
        logits = self.router(x)  # [N, E]
        if self.cfg.routing == "softmax_topk":  # in fp32 whatever the model's dtype, as the family defines it
            weights, experts = torch.topk(logits.softmax(-1, dtype=torch.float32), self.cfg.top_k, dim=-1)
            if self.cfg.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        else:
            top, experts = torch.topk(logits, self.cfg.top_k, dim=-1)
            weights = top.softmax(-1)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        experts, weights = self.route(x)  # [N, k] each
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # only the experts some token picked run
            token, slot = (experts == e).nonzero(as_tuple=True)
            h = F.linear(x[token], self.gate_up[e], None if self.gate_up_bias is None else self.gate_up_bias[e])
            h = F.linear(self.activate(h), self.down[e], None if self.down_bias is None else self.down_bias[e])
            out.index_add_(0, token, h * weights[token, slot, None])
        if self.shared_down is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared_down(F.silu(gate) * up)
        return out.view(shape)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.cfg.activation == "swiglu":
            return F.silu(gate) * up
        limit = self.cfg.swiglu_limit
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def experts_state(
    take: Callable[[str], torch.Tensor], prefix: str, cfg: ExpertsConfig, layout: str
) -> dict[str, torch.Tensor]:
    """One layer's expert tensors from a checkpoint (`take(name)` refuses a missing one) → SparseExperts'
    names under `prefix` (`layers.i.mlp.`). layout "per_expert": `experts.{e}.{gate,up,down}_proj.weight`
    and the router `gate.weight` (Qwen3-MoE; Qwen3.5-MoE with `shared_expert.*` and `shared_expert_gate`);
    "fused_interleaved": `experts.gate_up_proj` [E, H, 2I]
    with gate and up columns interleaved, `experts.down_proj` [E, I, H], biases, `router.*` (gpt-oss)."""
    E, I = cfg.num_experts, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    if layout == "per_expert":
        out[prefix + "router.weight"] = take(prefix + "gate.weight")
        out[prefix + "gate_up"] = torch.stack(
            [
                torch.cat(
                    [take(prefix + f"experts.{e}.gate_proj.weight"), take(prefix + f"experts.{e}.up_proj.weight")]
                )
                for e in range(E)
            ]
        )  # [E, 2I, H]
        out[prefix + "down"] = torch.stack([take(prefix + f"experts.{e}.down_proj.weight") for e in range(E)])
        if cfg.shared_intermediate_size:  # Qwen3.5-MoE, Qwen3-Next
            shared = prefix + "shared_expert."
            out[prefix + "shared_gate_up.weight"] = torch.cat(
                [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")]
            )
            out[prefix + "shared_down.weight"] = take(shared + "down_proj.weight")
            out[prefix + "shared_gate.weight"] = take(prefix + "shared_expert_gate.weight")
    elif layout == "fused_interleaved":
        out[prefix + "router.weight"] = take(prefix + "router.weight")
        out[prefix + "router.bias"] = take(prefix + "router.bias")
        gate_up, bias = take(prefix + "experts.gate_up_proj"), take(prefix + "experts.gate_up_proj_bias")
        if gate_up.dim() != 3 or gate_up.shape[0] != E or gate_up.shape[2] != 2 * I:
            raise LoopspecError(
                f"{prefix}experts.gate_up_proj has shape {list(gate_up.shape)}, not [{E}, hidden, {2 * I}]"
            )
        out[prefix + "gate_up"] = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1).transpose(1, 2)  # [E, 2I, H]
        out[prefix + "gate_up_bias"] = torch.cat([bias[..., 0::2], bias[..., 1::2]], -1)
        out[prefix + "down"] = take(prefix + "experts.down_proj").transpose(1, 2)  # [E, H, I]
        out[prefix + "down_bias"] = take(prefix + "experts.down_proj_bias")
    else:
        raise LoopspecError(f"unknown experts layout {layout!r}")
    return {k: v.contiguous() for k, v in out.items()}
