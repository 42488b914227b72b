"""Target model: Llama / Qwen2 / Qwen3 decoder with a static KV cache and hidden-state taps.

One forward runs `input_ids` at the positions that follow the cache's current length, appends their
K/V to the cache and returns the logits plus the taps (outputs of the decoder layers listed in
`target_layer_ids`, HF `hidden_states[l + 1]`) as a named output. Rolling back is moving
`cache.length`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.errors import LoopspecError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass
class TargetConfig:
    family: str  # llama | qwen2 | qwen3
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
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> "TargetConfig":
        """Build from a Hugging Face `config.json` dict."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise LoopspecError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_FAMILIES)})"
            )
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
        default_bias = model_type == "qwen2"
        return cls(
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
            attention_bias=hf.get("attention_bias", default_bias) if model_type != "qwen2" else True,
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
        )

    def to_dict(self) -> dict:
        return asdict(self)


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
    raise LoopspecError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


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
# KV cache


class KVCache:
    """Static K/V buffers for every layer plus an explicit length; rollback = set `length`."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_layers, batch, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.length = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, length: int) -> "KVCache":
        """A cache over existing buffers [N, B, kvh, S, hd] (e.g. one row of a BatchKVCache): writes go through."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.max_length, cache.length = k, v, k.shape[3], length
        return cache


class BatchKVCache:
    """Static K/V buffers for up to `rows` sequences, each with its own length (`lengths` [rows]).

    A ragged forward runs rows 0..B-1, so the caller keeps its live rows packed at the front
    (`move_row` fills a hole). `row(r)` is a one-row KVCache over the same buffers: the single-sequence
    path (e.g. a prefill) runs on it unchanged."""

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_layers, rows, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.lengths = torch.zeros(rows, dtype=torch.long)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def row(self, r: int) -> KVCache:
        return KVCache.over(self.k[:, r:r + 1], self.v[:, r:r + 1], int(self.lengths[r]))

    def write(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Every layer at once: the first counts[i] entries of k/v [N, R, kvh, T, hd] row i go to cache
        row rows[i] at its length, which advances by counts[i]."""
        starts = self.lengths[rows]  # lengths, rows and counts live on the host
        if int((starts + counts).max()) > self.max_length:
            raise LoopspecError(f"sequence of {int((starts + counts).max())} exceeds the context of {self.max_length}")
        i, t = (torch.arange(k.shape[3])[None, :] < counts[:, None]).nonzero(as_tuple=True)  # valid (row, token) pairs
        dev = self.k.device
        slots, dest, i, t = (starts[i] + t).to(dev), rows[i].to(dev), i.to(dev), t.to(dev)
        self.k[:, dest, :, slots] = k[:, i, :, t]  # [P, N, kvh, hd] on both sides
        self.v[:, dest, :, slots] = v[:, i, :, t]
        self.lengths[rows] = starts + counts

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n


class RaggedStep:
    """One ragged forward over rows 0..B-1 of a BatchKVCache: row b's first counts[b] new tokens are
    stored at its own length; padding tokens are never stored."""

    def __init__(self, cache: BatchKVCache, counts: torch.Tensor, width: int):
        self.cache, self.batch = cache, counts.shape[0]
        starts = cache.lengths[:self.batch]
        row_idx, t_idx = (torch.arange(width)[None, :] < counts[:, None]).nonzero(as_tuple=True)
        dev = cache.k.device
        self.row_idx, self.t_idx, self.slots = row_idx.to(dev), t_idx.to(dev), (starts[row_idx] + t_idx).to(dev)
        self.keys = int((starts + counts).max())  # key slots any real query can see

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [B, kvh, T, hd] → every row's keys/values [B, kvh, keys, hd] (masked per row by the caller)
        cache_k, cache_v = self.cache.k[layer, :self.batch], self.cache.v[layer, :self.batch]
        cache_k[self.row_idx, :, self.slots] = k[self.row_idx, :, self.t_idx]  # [P, kvh, hd]
        cache_v[self.row_idx, :, self.slots] = v[self.row_idx, :, self.t_idx]
        return cache_k[:, :, :self.keys], cache_v[:, :, :self.keys]


def causal_mask(q_len: int, past: int, device) -> torch.Tensor | None:
    """Bool mask [q_len, past+q_len]: query i sees keys 0 .. past+i. None when q_len == 1."""
    if q_len == 1:
        return None
    kv_len = past + q_len
    return torch.arange(kv_len, device=device)[None, :] <= (past + torch.arange(q_len, device=device))[:, None]


# --------------------------------------------------------------------------------------------------
# Target model


class TargetAttention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_out, kv_out, kv_out)
        # q, k and v fused into one matmul (one weight read, one kernel launch)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        # Llama/Qwen3 `attention_bias` also covers o_proj; Qwen2 has bias on q/k/v only
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, T, hd]
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not isinstance(cache, KVCache):  # a step that stores K/V itself: RaggedStep (rows of a
            keys, values = cache.store(layer, k, v)  # BatchKVCache), the CUDA-graph runner's StaticStep
        else:
            start = cache.length
            cache.k[layer, :, :, start:start + T] = k
            cache.v[layer, :, :, start:start + T] = v
            keys = cache.k[layer, :, :, :start + T]  # [B, kvh, S, hd]
            values = cache.v[layer, :, :, :start + T]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TargetAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, T, V] (only the last position when last_logits_only)
    taps: torch.Tensor | None  # [B, T, n_taps * H], concatenated in target_layer_ids order


class Target(nn.Module):
    def __init__(self, cfg: TargetConfig, target_layer_ids: list[int] | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.target_layer_ids: list[int] = []
        self.set_taps(target_layer_ids or [])

    def set_taps(self, target_layer_ids: list[int]) -> None:
        for layer in target_layer_ids:
            if not 0 <= layer < self.cfg.num_layers:
                raise LoopspecError(
                    f"tap layer {layer} is out of range for a target with {self.cfg.num_layers} layers"
                )
        self.target_layer_ids = list(target_layer_ids)

    def new_cache(self, max_length: int, batch: int = 1) -> KVCache:
        if max_length > self.cfg.max_position_embeddings:
            max_length = self.cfg.max_position_embeddings
        p = self.embed_tokens.weight
        return KVCache(self.cfg.num_layers, batch, self.cfg.num_kv_heads, max_length, self.cfg.head_dim,
                       dtype=p.dtype, device=p.device)

    def new_batch_cache(self, max_length: int, rows: int) -> BatchKVCache:
        p = self.embed_tokens.weight
        return BatchKVCache(self.cfg.num_layers, rows, self.cfg.num_kv_heads,
                            min(max_length, self.cfg.max_position_embeddings), self.cfg.head_dim,
                            dtype=p.dtype, device=p.device)

    @torch.no_grad()  # not inference_mode: taps feed drafter training, whose autograd must save them
    def forward(self, input_ids: torch.Tensor, cache: KVCache, want_taps: bool = True,
                last_logits_only: bool = False, positions: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None) -> TargetOutput:
        """Run `input_ids` [B, T] in the cache slots after `cache.length`; advances it by T.

        positions: [B, T] per-row absolute positions (default: the slot index, same for every row).
        key_mask: [B, cache.length + T] bool, False for slots a row must ignore (e.g. left padding)."""
        B, T = input_ids.shape
        start = cache.length
        if start + T > cache.max_length:
            raise LoopspecError(f"sequence of {start + T} tokens exceeds the context of {cache.max_length}")
        if positions is None:
            cos, sin = self.rotary(torch.arange(start, start + T, device=input_ids.device))
            cos, sin = cos[None, None], sin[None, None]  # [1, 1, T, hd]
        else:
            cos, sin = self.rotary(positions)
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
        mask = causal_mask(T, start, input_ids.device)
        if key_mask is not None:
            causal = mask if mask is not None else torch.ones(T, start + T, dtype=torch.bool, device=input_ids.device)
            mask = causal[None, None] & key_mask[:, None, None, :]  # [B, 1, T, S]
            # every query keeps its own slot: a padding query then attends to itself instead of to
            # nothing (which would give NaN K/V that poison the real rows through 0 * NaN)
            own = torch.arange(start + T, device=input_ids.device)[None, :] == (start + torch.arange(T, device=input_ids.device))[:, None]
            mask = mask | own[None, None]
        out = self._stack(self.embed_tokens(input_ids), cos, sin, cache, mask, want_taps, last_logits_only)
        cache.length = start + T
        return out

    @torch.no_grad()
    def forward_ragged(self, input_ids: torch.Tensor, counts: torch.Tensor, cache: BatchKVCache,
                       want_taps: bool = True) -> TargetOutput:
        """Rows 0..B-1 of `cache` at once, each at its own length: row b runs its first counts[b]
        tokens of `input_ids` [B, T] (right-padded; counts is a host tensor [B]) and advances by
        counts[b]. Row b's outputs equal those of running its tokens alone (fp32 summation order
        aside); padding outputs are junk."""
        B, T = input_ids.shape
        starts = cache.lengths[:B]
        if int((starts + counts).max()) > cache.max_length:
            raise LoopspecError(f"sequence of {int((starts + counts).max())} tokens exceeds the context of {cache.max_length}")
        step = RaggedStep(cache, counts, T)
        dev = input_ids.device
        positions = (starts[:, None] + torch.arange(T)[None, :]).to(dev)  # [B, T]
        cos, sin = self.rotary(positions.clamp_max(cache.max_length - 1))  # padding may run past the end
        # query t of row b sees that row's slots 0 .. start_b + t: its history and its own new tokens
        mask = torch.arange(step.keys, device=dev)[None, None, :] <= positions[:, :, None]  # [B, T, keys]
        out = self._stack(self.embed_tokens(input_ids), cos[:, None], sin[:, None], step, mask[:, None],
                          want_taps, last_logits_only=False)
        cache.lengths[:B] = starts + counts
        return out

    def _stack(self, x, cos, sin, cache, mask, want_taps: bool, last_logits_only: bool) -> TargetOutput:
        """The decoder layers, final norm and lm_head over embeddings x [B, T, H]."""
        tapped = set(self.target_layer_ids) if want_taps else set()
        taps: dict[int, torch.Tensor] = {}
        last = self.cfg.num_layers - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask)
            if i in tapped:
                taps[i] = x
        x = self.norm(x)
        if last in tapped:
            taps[last] = x  # HF's hidden_states[L] is the final-normed output; keep that meaning
        logits = self.lm_head(x[:, -1:] if last_logits_only else x)
        tap_tensor = torch.cat([taps[i] for i in self.target_layer_ids], dim=-1) if taps else None
        return TargetOutput(logits=logits, taps=tap_tensor)
