"""Target model: Llama / Qwen2 / Qwen3 decoder with a static KV cache and hidden-state taps.

One forward runs rows of `input_ids`, each at the positions that follow its own length in the
cache, appends their K/V and returns the logits plus the taps (outputs of the decoder layers listed
in `target_layer_ids`, HF `hidden_states[l + 1]`) as a named output. Rolling back is lowering a
row's length (`KVCache.rollback`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.errors import LoopspecError
from loopspec.model.kv_cache import KVCache, KVWrite, RecurrentCache, WindowedCache, attention_mask

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclass
class TargetConfig:
    family: str  # the checkpoint's model_type (loopspec.model.families lists them)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_parameters minus rope_theta; None = default RoPE
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm per head on q and k before RoPE
    attention_output_gate: bool = False  # Qwen3.5: q_proj also yields a gate per head; output × sigmoid(gate)
    partial_rotary_factor: float = 1.0  # Qwen3.5: RoPE turns the first head_dim × factor dims of each head
    norm_plus_one: bool = False  # Qwen3.5: every RMSNorm scales by (1 + weight), computed in fp32
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    layer_types: list[str] = field(default_factory=list)  # one of LAYER_TYPES per layer; [] = all full attention
    sliding_window: int | None = None  # a sliding_attention query sees the keys of its last `sliding_window` positions
    attention_sinks: bool = False  # gpt-oss: one learned logit per head joins every softmax
    experts: Any = None  # loopspec.model.experts.ExpertsConfig: the MoE feed-forward, or None (dense SwiGLU)
    linear_attention: Any = None  # a hybrid family's linear-attention layers (loopspec.model.qwen3_5)

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else "full_attention"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE turns (all of them but with partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        return asdict(self)


def dense_config(hf: dict, **family_fields) -> TargetConfig:
    """The fields every decoder family shares, read from an HF config dict, plus the family's own."""
    model_type = hf.get("model_type")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise LoopspecError(f"target config.json lacks {key!r}")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None if rope_type == "default" else rope
    eos = hf.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    fields = dict(
        family=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False),
        eos_token_ids=eos_ids,
        bos_token_id=hf.get("bos_token_id"),
    )
    fields.update(family_fields)
    cfg = TargetConfig(**fields)
    if cfg.layer_types and (len(cfg.layer_types) != cfg.num_layers or set(cfg.layer_types) - set(LAYER_TYPES)):
        raise LoopspecError(
            f"target config.json's layer_types must name one of {', '.join(LAYER_TYPES)} for each "
            f"of its {cfg.num_layers} layers, got {cfg.layer_types}"
        )
    if "sliding_attention" in cfg.layer_types and not (cfg.sliding_window or 0) > 0:
        raise LoopspecError("target config.json has sliding_attention layers but no positive sliding_window")
    return cfg


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """Tap layers spread from layer 1 to L-3: round(1 + i*(L-4)/(n-1)); one tap → [L//2]."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    # Python's round (half to even) is what the published DFlash drafters used: L=30 → [1, 8, 14, 20, 27]
    return [int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps)]


# --------------------------------------------------------------------------------------------------
# Shared building blocks (the drafter uses them too)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the 16-bit path below matches HF's upcast
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class PlusOneRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: normalised in fp32, scaled by (1 + weight) in fp32, then cast back — the
    weight is stored as checkpoints hold it (zero-centred); the 1 is added at every call so that a
    16-bit model rounds as transformers' does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def new_norm(cfg: TargetConfig, dim: int) -> nn.Module:
    """The family's RMSNorm over `dim` features."""
    return PlusOneRMSNorm(dim, cfg.rms_norm_eps) if cfg.norm_plus_one else RMSNorm(dim, cfg.rms_norm_eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for default / linear / llama3 RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    raise LoopspecError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: the high frequencies kept, the low ones divided by `factor`, a linear ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context; cos/sin scaled by
    0.1·ln(factor) + 1 unless `attention_factor` is given (mscale / mscale_all_dim as their ratio)."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def turns_dim(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in old_ctx
        return head_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_dim(scaling.get("beta_fast") or 32), turns_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, float(attention)


class RotaryTable(nn.Module):
    """cos/sin for every position up to `max_positions`, looked up by absolute position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]  # [..., T, hd] each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, hd]; cos/sin: [B, 1, T, hd] (rotate-half convention of HF)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over the first cos.shape[-1] dims of each head, the rest passed through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PackedLinear(nn.Module):
    """An inference copy of a Linear whose weight is prepacked for oneDNN (mkldnn) on CPU.

    Same values and the same `weight` parameter (kept for tying, saving and training); without grad
    the product runs on the packed copy. Measured on 2 cores: one-row lm_head 4.2 → 2.6 ms, 16 rows
    13.2 → 5.0 ms. With grad enabled it is a plain Linear."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # oneDNN layout chosen for one-row products (decoding); dense tensors in and out
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        bias = None if self.bias is None else self.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), self.packed, bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)


def inference_linear(weight: torch.Tensor) -> nn.Module:
    """A bias-free inference Linear over `weight` [out, in], oneDNN-packed when possible."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    holder = nn.Sequential(linear)
    return pack_linears_for_cpu_(holder)[0]


def pack_linears_for_cpu_(module: nn.Module) -> nn.Module:
    """Swap every fp32 CPU Linear of `module` for a PackedLinear (no-op where oneDNN is missing)."""
    if not torch.backends.mkldnn.is_available():
        return module
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child))
        else:
            pack_linears_for_cpu_(child)
    return module


# --------------------------------------------------------------------------------------------------
# Target model


class LayerStep:
    """What every decoder layer of one forward reads besides its input: the rotary cos/sin of the new
    tokens, the cache and where their K/V go, the attention mask over the first `write.keys` slots and
    the new tokens' positions. A sliding-window layer asks `mask_for(window)`: the mask with the keys a
    window drops hidden (built once per forward and window). A linear-attention layer reads `counts`
    (its padding must not advance a row's state) and `keep_states` (whether the cache keeps the state
    after each new token, so that the forward can be rolled back inside)."""

    def __init__(
        self,
        cos,
        sin,
        cache: KVCache,
        write: KVWrite,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        counts: torch.Tensor | None = None,
        keep_states: bool = False,
    ):
        self.cos, self.sin = cos, sin  # [B, 1, T, rotary dims]
        self.cache, self.write = cache, write
        self.mask = mask  # [B, 1, T, keys] bool, or None: every slot up to the query is seen
        self.positions = positions  # [B, T] on the models' device
        self.counts = counts  # [B] real tokens per row (host), None: every row all T
        self.keep_states = keep_states
        self._windowed: dict[int, torch.Tensor] = {}

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer that sees only keys at positions > its query's - window (None: all)."""
        if window is None:
            return self.mask
        if window not in self._windowed:
            keys = key_positions(self.write, self.positions, self.cache.lengths)  # [B, keys]
            near = keys[:, None, None, :] > self.positions[:, None, :, None] - window  # [B, 1, T, keys]
            self._windowed[window] = near if self.mask is None else self.mask & near
        return self._windowed[window]


def key_positions(write: KVWrite, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The position of each of the first `write.keys` slots of the write's rows → [B, keys]: a committed
    slot's position is its index; a new token's slot holds the new token's position (a tree node sits
    at its depth, not at its slot)."""
    B, T = positions.shape
    keys = torch.arange(write.keys, device=positions.device).expand(B, -1).clone()  # [B, keys]
    if write.start is not None:
        width = min(T, write.keys - write.start)
        keys[:, write.start : write.start + width] = positions[:, :width]
    elif write.row_index is None:
        keys[0, write.slots] = positions[0, : write.slots.shape[0]]
    else:
        keys[write.row_index, write.slots] = positions[write.row_index, write.token_index]
    return keys


class TargetAttention(nn.Module):
    """Grouped-query attention over the cache; `window` (sliding-window layers) hides keys more than
    window - 1 positions back; `sinks` (one learned logit per head) joins every softmax as a column
    whose probability is dropped, so a query may attend to nothing."""

    def __init__(self, cfg: TargetConfig, window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.gated = cfg.attention_output_gate  # q_proj's rows: per head, hd of query then hd of gate
        self.split = (2 * q_out if self.gated else q_out, kv_out, kv_out)
        self.window = window
        # q, k and v fused into one matmul (one weight read, one kernel launch)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        # Llama/Qwen3 `attention_bias` also covers o_proj; Qwen2 has bias on q/k/v only
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        self.q_norm = new_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = new_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None

    def forward(self, x: torch.Tensor, step: LayerStep, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [B, T, h, hd] each
            q, gate = q.reshape(B, T, self.num_heads, self.head_dim), gate.reshape(B, T, -1)  # gate [B, T, h·hd]
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, T, hd]
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rope(q, step.cos, step.sin), apply_partial_rope(k, step.cos, step.sin)
        keys, values, mask = step.cache.attended(layer, k, v, step, self.window)  # [B, kvh, S, hd] each
        if self.sinks is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        else:
            out = sink_attention(q, keys, values, mask, self.sinks)
        out = out.transpose(1, 2).reshape(B, T, -1)  # [B, T, h·hd]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def sink_attention(q, keys, values, mask, sinks):
    """softmax([q·k / sqrt(hd) ; sink]) without the sink's column, times V. q [B, h, T, hd],
    keys/values [B, kvh, S, hd], mask [B, 1, T, S] or None, sinks [h] → [B, h, T, hd]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [B, h, S, hd]
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, h, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)  # [B, h, T, 1]
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return probs @ values


class TargetLayer(nn.Module):
    """Pre-norm decoder layer: a token mixer (attention, full or windowed, or a family's linear
    attention) and a feed-forward (SwiGLU, or a family's mixture of experts), as the family's record
    builds them (loopspec.model.families.new_target)."""

    def __init__(self, cfg: TargetConfig, index: int, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = new_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = new_norm(cfg, cfg.hidden_size)
        self.mlp = mlp
        self.mixer_name = mixer_name(cfg, index)
        setattr(self, self.mixer_name, mixer)

    def forward(self, x: torch.Tensor, step: LayerStep, layer: int) -> torch.Tensor:
        x = x + getattr(self, self.mixer_name)(self.input_layernorm(x), step, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def mixer_name(cfg: TargetConfig, index: int) -> str:
    """The token mixer's module name in checkpoints: `linear_attn` for linear attention, else `self_attn`."""
    return "linear_attn" if cfg.layer_type(index) == "linear_attention" else "self_attn"


def target_rotary(cfg: TargetConfig) -> RotaryTable:
    """The target's RoPE table: over the rotary dims of a head (all of them unless partial rotary).
    Qwen3.5's multimodal RoPE gives text tokens one position in all three sections, which is this."""
    return RotaryTable(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


class TargetOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, T, V] (only the last position when last_logits_only)
    taps: torch.Tensor | None  # [B, T, n_taps * H], concatenated in target_layer_ids order


class Target(nn.Module):
    """The decoder: embedding, `layers` (TargetLayers, built by the family: loopspec.model.families.new_target),
    final norm and lm_head."""

    def __init__(self, cfg: TargetConfig, layers: list[TargetLayer], target_layer_ids: list[int] | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = new_norm(cfg, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = target_rotary(cfg)
        self.target_layer_ids: list[int] = []
        self.set_taps(target_layer_ids or [])

    def set_taps(self, target_layer_ids: list[int]) -> None:
        for layer in target_layer_ids:
            if not 0 <= layer < self.cfg.num_layers:
                raise LoopspecError(f"tap layer {layer} is out of range for a target with {self.cfg.num_layers} layers")
        self.target_layer_ids = list(target_layer_ids)

    def new_cache(self, max_length: int, rows: int = 1) -> KVCache:
        """The KV cache of `rows` rows; with linear-attention layers a RecurrentCache, which also holds
        their states (KV buffers for the attention layers only); with sliding-window layers a
        WindowedCache, which keeps each one's window only."""
        p = self.embed_tokens.weight
        length = min(max_length, self.cfg.max_position_embeddings)
        if self.cfg.linear_attention is not None:
            linear = [self.cfg.layer_type(i) == "linear_attention" for i in range(self.cfg.num_layers)]
            return RecurrentCache(
                linear,
                self.cfg.linear_attention,
                rows,
                self.cfg.num_kv_heads,
                length,
                self.cfg.head_dim,
                dtype=p.dtype,
                device=p.device,
            )
        sliding = [self.cfg.layer_type(i) == "sliding_attention" for i in range(self.cfg.num_layers)]
        if any(sliding):
            return WindowedCache(
                sliding,
                self.cfg.sliding_window,
                rows,
                self.cfg.num_kv_heads,
                length,
                self.cfg.head_dim,
                dtype=p.dtype,
                device=p.device,
            )
        return KVCache(
            self.cfg.num_layers, rows, self.cfg.num_kv_heads, length, self.cfg.head_dim, dtype=p.dtype, device=p.device
        )

    @torch.no_grad()  # not inference_mode: taps feed drafter training, whose autograd must save them
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        want_taps: bool = True,
        last_logits_only: bool = False,
        first_row: int = 0,
        counts: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Rows first_row.. of `cache`, each after its own length: row b runs its first counts[b]
        tokens of `input_ids` [B, T] (right-padded; counts a host tensor [B], default all T) and
        advances by counts[b]. Row b's outputs equal those of running its tokens alone (fp32
        summation order aside); padding outputs are junk. last_logits_only: each row's last real
        position only ([B, 1, V]).

        tree_mask (host bool [B, T, T], default the causal chain): which of the new tokens each new
        token sees — a draft tree's ancestor mask (loopspec.tree.tree_masks). Token t then sits at
        position length + depth(t), its depth being the number of ancestors it sees; its K/V are
        stored at slot length + t all the same (the commit moves the accepted path into place).

        With linear-attention layers (a RecurrentCache) each row's state advances by its real tokens;
        unless last_logits_only (a prefill, never rolled back into) the cache keeps the state after
        each of them, so that the row may be rolled back to any length inside this forward."""
        B, T = input_ids.shape
        if tree_mask is not None and self.cfg.linear_attention is not None:
            raise LoopspecError(
                f"a {self.cfg.family} target's linear-attention state follows one path: "
                "it verifies chains, not draft trees"
            )
        counts = torch.full((B,), T) if counts is None else counts
        write = cache.plan(first_row, counts, T)
        dev = input_ids.device
        starts = cache.lengths[write.rows]
        offsets = torch.arange(T)[None, :] if tree_mask is None else tree_mask.sum(-1) - 1  # [B or 1, T]
        positions = starts[:, None] + offsets  # [B, T]
        positions = positions.clamp_max(cache.max_length - 1).to(dev)  # padding may run past the end
        cos, sin = self.rotary(positions)
        mask = None  # one query per row at one length sees every slot up to itself: no mask needed
        if T > 1 or write.start is None or tree_mask is not None:
            mask = attention_mask(starts, T, write.keys, tree_mask)[:, None].to(dev)  # [B, 1, T, keys]
        last = (counts - 1).to(dev) if last_logits_only else None
        # a caller that reads only the last logits (a prefill) accepts no prefix of the forward: no
        # recurrent state inside it is worth keeping for a rollback
        step = LayerStep(
            cos[:, None], sin[:, None], cache, write, mask, positions, counts, keep_states=not last_logits_only
        )
        out = self._stack(self.embed_tokens(input_ids), step, want_taps, last)
        cache.lengths[write.rows] = starts + counts
        return out

    def _stack(self, x, step: LayerStep, want_taps: bool, last_index: torch.Tensor | None) -> TargetOutput:
        """The decoder layers, final norm and lm_head over embeddings x [B, T, H]; logits at every
        position, or only at each row's `last_index` [B]."""
        tapped = set(self.target_layer_ids) if want_taps else set()
        taps: dict[int, torch.Tensor] = {}
        last = self.cfg.num_layers - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, step, i)
            if i in tapped:
                taps[i] = x
        x = self.norm(x)
        if last in tapped:
            taps[last] = x  # HF's hidden_states[L] is the final-normed output; keep that meaning
        logits = self.lm_head(x if last_index is None else x[torch.arange(x.shape[0]), last_index][:, None])
        tap_tensor = torch.cat([taps[i] for i in self.target_layer_ids], dim=-1) if taps else None
        return TargetOutput(logits=logits, taps=tap_tensor)
