"""Qwen3.5 (model_type qwen3_5, its text-only form qwen3_5_text; Qwen3.5-MoE likewise): a hybrid decoder
whose Gated DeltaNet linear-attention layers sit between gated full-attention layers.

A linear-attention layer carries, per row, a causal depthwise conv over its last conv_kernel - 1
inputs and a recurrent state per value head (dk × dv) that the gated delta rule updates once per
token. Both live in the target's RecurrentCache (loopspec.model.kv_cache), which keeps the state after
each token of a verification so that a rejected tail is rolled back by lowering the row's length. The
rule runs token by token in every forward (prefill and verification alike), so the state after token
j of a verification is the one plain one-token decoding reaches.

transformers computes parts of this layer in fp32 whatever the model's dtype; so does this module,
op for op, so that an fp64 model matches its one-token decoding to the last bits: the delta rule
(q, k, v, g, beta cast to fp32, the state kept in fp32), the gated RMSNorm's normalisation and gate,
and exp(A_log). Its full-attention layers are TargetAttention with the output gate, partial rotary
and (1 + weight) norms switched on (loopspec.model.target).

Qwen3-Next (model_type qwen3_next) is the same decoder with two differences in its checkpoint: the
linear attention's projections are fused per key-head group (in_proj_qkvz, in_proj_ba), rearranged
at load into this module's layout, and its feed-forward is routed experts with a gated shared expert
on the layers decoder_sparse_step and mlp_only_layers pick, dense SwiGLU on the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.errors import LoopspecError
from loopspec.model.experts import ExpertsConfig
from loopspec.model.target import LayerStep, TargetConfig, dense_config

HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers' widths (HF linear_* fields)."""

    conv_kernel: int  # linear_conv_kernel_dim: the causal conv sees this many inputs, the current one included
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each key head serves a group of value heads

    @property
    def key_dim(self) -> int:
        return self.key_head_dim * self.num_key_heads

    @property
    def value_dim(self) -> int:
        return self.value_head_dim * self.num_value_heads

    @property
    def conv_dim(self) -> int:  # the conv runs over q, k and v together
        return 2 * self.key_dim + self.value_dim


def text_config(hf: dict) -> dict:
    """The decoder's fields: a multimodal config's text_config, with the top level's ids and tying
    (transformers ties the multimodal model's lm_head by its top-level flag); a text-only config as is."""
    if "text_config" not in hf:
        return hf
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config") and v is not None}
    text = {**top, **hf["text_config"]}
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def hybrid_family(model_type) -> str:
    """The family a hybrid config reads as: the multimodal and text-only model_types are one family."""
    return str(model_type).removesuffix("_text")


def read_qwen3_5_config(hf: dict) -> TargetConfig:
    """Qwen3.5, Qwen3.5-MoE and Qwen3-Next (their configs name the same fields)."""
    text = text_config(hf)
    family = hybrid_family(hf.get("model_type"))
    widths = {}
    for key in (
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ):
        value = text.get(key)
        if not isinstance(value, int) or value < 1:
            raise LoopspecError(f"{family} config.json needs a positive integer {key}, got {value!r}")
        widths[key] = value
    linear = LinearAttentionConfig(
        widths["linear_conv_kernel_dim"],
        widths["linear_key_head_dim"],
        widths["linear_value_head_dim"],
        widths["linear_num_key_heads"],
        widths["linear_num_value_heads"],
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise LoopspecError(
            f"{family} config.json's linear_num_value_heads ({linear.num_value_heads}) must be a "
            f"multiple of linear_num_key_heads ({linear.num_key_heads})"
        )
    layers = text.get("num_hidden_layers", 0)
    types = text.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th layer is full attention
        interval = text.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - set(HYBRID_LAYER_TYPES):
        raise LoopspecError(
            f"{family} config.json's layer_types must name linear_attention or full_attention for "
            f"each of its {layers} layers, got {types}"
        )
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    experts = None
    if family == "qwen3_next":
        experts = next_experts(text, layers)
    elif family == "qwen3_5_moe":
        experts = moe_experts(text, family, tuple(range(layers)), norm_topk_prob=True)
    if experts is not None and len(experts.sparse_layers) == layers:  # no dense feed-forward: its width is unused
        text = {"intermediate_size": text.get("moe_intermediate_size"), **text}
    cfg = dense_config(
        text,
        family=family,
        qk_norm=True,
        attention_output_gate=True,
        norm_plus_one=True,
        partial_rotary_factor=factor,
        layer_types=list(types),
        experts=experts,
        linear_attention=linear if "linear_attention" in types else None,
    )
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise LoopspecError(
            f"{family} config.json's partial_rotary_factor {factor} turns {cfg.rotary_dim} of "
            f"{cfg.head_dim} head dims: RoPE needs a positive even number"
        )
    return cfg


def moe_experts(text: dict, family: str, sparse_layers: tuple[int, ...], norm_topk_prob: bool) -> ExpertsConfig:
    """The hybrids' sparse feed-forward: softmax over the experts, the top k (renormalised with
    norm_topk_prob), and a shared expert gated by a sigmoid."""
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if not isinstance(text.get(key), int) or text[key] < 1:
            raise LoopspecError(f"{family} config.json needs a positive integer {key}, got {text.get(key)!r}")
    return ExpertsConfig(
        text["num_experts"],
        text["num_experts_per_tok"],
        text["moe_intermediate_size"],
        sparse_layers,
        routing="softmax_topk",
        norm_topk_prob=norm_topk_prob,
        shared_intermediate_size=text["shared_expert_intermediate_size"],
    )


def next_experts(text: dict, layers: int) -> ExpertsConfig | None:
    """Qwen3-Next's experts: on every decoder_sparse_step-th layer outside mlp_only_layers (none when
    num_experts is 0, as transformers builds it)."""
    if text.get("num_experts", 512) == 0:
        return None
    step, dense_layers = text.get("decoder_sparse_step", 1), text.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1 or not isinstance(dense_layers, list):
        raise LoopspecError(
            f"qwen3_next config.json needs a positive integer decoder_sparse_step and a list "
            f"mlp_only_layers, got {step!r} and {dense_layers!r}"
        )
    sparse = tuple(i for i in range(layers) if i not in dense_layers and (i + 1) % step == 0)
    return moe_experts(text, "qwen3_next", sparse, norm_topk_prob=bool(text.get("norm_topk_prob", True)))


def linear_attention_state(
    take, prefix: str, cfg: TargetConfig, fused_per_group: bool = False
) -> dict[str, torch.Tensor]:
    """One Gated DeltaNet layer's tensors under `prefix` (`layers.i.linear_attn.`): in_proj_qkv, _z, _b
    and _a fused into one matmul (Qwen3-Next's in_proj_qkvz and in_proj_ba with `fused_per_group`),
    the rest as the checkpoint holds them."""
    if fused_per_group:
        in_proj = ungroup_qwen3_next_projections(
            take(prefix + "in_proj_qkvz.weight"), take(prefix + "in_proj_ba.weight"), cfg, prefix
        )
    else:
        in_proj = torch.cat([take(prefix + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])
    return {
        prefix + "in_proj.weight": in_proj,
        prefix + "conv_weight": take(prefix + "conv1d.weight"),
        prefix + "dt_bias": take(prefix + "dt_bias"),
        prefix + "A_log": take(prefix + "A_log"),
        prefix + "norm.weight": take(prefix + "norm.weight"),
        prefix + "out_proj.weight": take(prefix + "out_proj.weight"),
    }


def ungroup_qwen3_next_projections(
    qkvz: torch.Tensor, ba: torch.Tensor, cfg: TargetConfig, prefix: str
) -> torch.Tensor:
    """Qwen3-Next's fused projections → GatedDeltaNet's in_proj rows [q | k | v | z | b | a]. Its rows
    run per key head h: in_proj_qkvz holds q_h (dk), k_h (dk), then v and z of the key head's group of
    value heads (group × dv each); in_proj_ba holds b then a of that group (group each). A value head's
    index is h × group + j in both layouts, so each part is the key heads' slices laid end to end."""
    dims: LinearAttentionConfig = cfg.linear_attention
    group = dims.num_value_heads // dims.num_key_heads
    qkvz_rows = 2 * dims.key_head_dim + 2 * group * dims.value_head_dim  # per key head
    for name, tensor, rows in (
        ("in_proj_qkvz", qkvz, dims.num_key_heads * qkvz_rows),
        ("in_proj_ba", ba, 2 * dims.num_value_heads),
    ):
        if tuple(tensor.shape) != (rows, cfg.hidden_size):
            raise LoopspecError(
                f"{prefix}{name}.weight has shape {list(tensor.shape)}, not [{rows}, {cfg.hidden_size}]"
            )
    per_head = qkvz.reshape(dims.num_key_heads, qkvz_rows, cfg.hidden_size)  # [Hk, 2dk + 2·group·dv, H]
    q, k, v, z = per_head.split(
        (dims.key_head_dim, dims.key_head_dim, group * dims.value_head_dim, group * dims.value_head_dim), dim=1
    )
    b, a = ba.reshape(dims.num_key_heads, 2 * group, cfg.hidden_size).split((group, group), dim=1)  # [Hk, group, H]
    return torch.cat([part.reshape(-1, cfg.hidden_size) for part in (q, k, v, z, b, a)])


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The depthwise conv over window [B, C, K-1+T] (each channel's past inputs, then the new ones) with
    weight [C, 1, K] → [B, C, T], output t seeing inputs t..t+K-1. Written out: torch's grouped conv1d
    has no fp64 CPU kernel and falls back to one slow convolution per channel."""
    taps = window.unfold(-1, weight.shape[-1], 1)  # [B, C, T, K]
    return (taps * weight[:, 0, None, :]).sum(dim=-1)


def snapshot_slot(token: int) -> int:
    """The slot of kept states that holds the state after the forward's token `token` (0-based; -1:
    the state before the forward): the state after j tokens sits at slot j, the row's length + j."""
    return token + 1


def gated_delta_rule(q, k, v, g, beta, state, kept: torch.Tensor | None = None):
    """The gated delta rule token by token, in fp32. q, k [R, H, T, dk] (q already scaled), v [R, H, T,
    dv], g (log decay) and beta [R, H, T], state [R, H, dk, dv] → outputs [R, H, T, dv] and the final
    state. Per token: S ← S·exp(g); S ← S + k ⊗ beta·(v − kᵀS); out = qᵀS. kept [R, T + 1, H, dk, dv]:
    receives the state before and after every token (written in place: keeping them costs no copy)."""
    R, H, T, dv = v.shape
    out = torch.zeros(R, H, T, dv, dtype=v.dtype, device=v.device)
    if kept is not None:
        kept[:, snapshot_slot(-1)] = state
    for t in range(T):
        state = state * g[:, :, t].exp().unsqueeze(-1).unsqueeze(-1)
        remembered = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)  # [R, H, dv]
        delta = (v[:, :, t] - remembered) * beta[:, :, t].unsqueeze(-1)
        update = k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)  # [R, H, dk, dv]
        state = state + update if kept is None else torch.add(state, update, out=kept[:, snapshot_slot(t)])
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out, state


class GatedRMSNorm(nn.Module):
    """RMSNorm of x (normalised in fp32, scaled by weight in x's dtype), times silu(gate) taken in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.to(torch.float32)
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(dtype)) * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet linear-attention layer: the input projected to q, k, v (through a causal
    depthwise conv and silu), an output gate z, the write strength beta = sigmoid(b) and the decay
    g = -exp(A_log)·softplus(a + dt_bias) per value head; the delta rule over the row's state; the
    gated RMSNorm and out_proj."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        dims: LinearAttentionConfig = cfg.linear_attention
        self.dims = dims
        self.split = (dims.conv_dim, dims.value_dim, dims.num_value_heads, dims.num_value_heads)
        # in_proj_qkv, _z, _b and _a fused into one matmul (one weight read)
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(dims.conv_dim, 1, dims.conv_kernel))  # depthwise, no bias
        self.dt_bias = nn.Parameter(torch.ones(dims.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(dims.num_value_heads))
        self.norm = GatedRMSNorm(dims.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(dims.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, step: LayerStep, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        dims, cache, rows = self.dims, step.cache, step.write.rows
        mixed, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        conv_state, state = cache.states(layer, rows)  # [B, C, K-1], [B, Hv, dk, dv] fp32
        window = torch.cat([conv_state, mixed.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
        mixed = F.silu(causal_conv(window, self.conv_weight)).transpose(1, 2)  # [B, T, C]
        q, k, v = mixed.split((dims.key_dim, dims.key_dim, dims.value_dim), dim=-1)
        q = l2_normalize(q.reshape(B, T, dims.num_key_heads, dims.key_head_dim))  # [B, T, Hk, dk]
        k = l2_normalize(k.reshape(B, T, dims.num_key_heads, dims.key_head_dim))
        v = v.reshape(B, T, dims.num_value_heads, dims.value_head_dim)  # [B, T, Hv, dv]
        group = dims.num_value_heads // dims.num_key_heads
        if group > 1:  # each key head serves `group` consecutive value heads
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        beta = b.sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, T, Hv]
        # the rule's layout [B, Hv, T, ·] in fp32, as transformers computes it whatever the model's dtype
        q, k, v, beta, g = (t.transpose(1, 2).contiguous().to(torch.float32) for t in (q, k, v, beta, g))
        q = q * (1 / (dims.key_head_dim**0.5))
        counts = torch.full((B,), T) if step.counts is None else step.counts
        if bool((counts < T).any()):  # padding keeps the state exactly: decay exp(0) = 1, write strength 0
            padding = (torch.arange(T)[None, :] >= counts[:, None]).to(x.device)[:, None, :]  # [B, 1, T]
            g, beta = g.masked_fill(padding, 0.0), beta.masked_fill(padding, 0.0)
        kept = cache.kept_states(layer, rows, T) if step.keep_states else None
        out, state = gated_delta_rule(q, k, v, g, beta, state, kept)
        cache.keep(layer, rows, window, state, counts, kept is not None)
        out = out.transpose(1, 2).contiguous().to(x.dtype)  # [B, T, Hv, dv]
        out = self.norm(out.reshape(-1, dims.value_head_dim), z.reshape(-1, dims.value_head_dim))
        return self.out_proj(out.reshape(B, T, dims.value_dim))
