"""Target model: Llama / Qwen2 / Qwen3 decoder with a static KV cache and hidden-state taps.

One forward runs rows of `input_ids`, each at the positions that follow its own length in the
cache, appends their K/V and returns the logits plus the taps (outputs of the decoder layers listed
in `target_layer_ids`, HF `hidden_states[l + 1]`) as a named output. Rolling back is lowering a
row's length (`KVCache.rollback`).
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


class KVWrite(NamedTuple):
    """Where one forward's new K/V go in a KVCache, and which key slots its queries see.

    Exactly one form: `start` (every token of every row at slots start.., all rows at one length);
    `slots` alone (one row, token t at slots[t]: the CUDA-graph replays, whose slots are a static
    tensor); or `slots` with `row_index`/`token_index` (ragged rows: only real tokens are stored)."""

    rows: slice  # the forward's rows in the cache
    keys: int  # key slots 0..keys-1 are read (the caller's mask hides what a query must not see)
    start: int | None = None
    slots: torch.Tensor | None = None  # [P]
    row_index: torch.Tensor | None = None  # [P] forward row of each stored (row, token) pair
    token_index: torch.Tensor | None = None  # [P]


def one_block(starts: torch.Tensor, counts: torch.Tensor, width: int) -> int | None:
    """The common start slot when every row writes all `width` tokens from one length (a dense slice
    then stores them), else None."""
    if bool((counts == width).all()) and bool((starts == starts[0]).all()):
        return int(starts[0])
    return None


def attention_mask(starts: torch.Tensor, width: int, keys: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Which of the first `keys` slots each of `width` new tokens sees, its row's new tokens stored
    from starts[b] [B] on → bool [B, width, keys]: every slot before starts[b] (the committed
    history) and, among the new tokens, those tree_mask[b, t] marks (default: tokens 0 .. t, the
    causal chain). Stale slots past a row's tokens are never seen."""
    rel = torch.arange(keys)[None, :] - starts[:, None]  # [B, keys]: the slot's index among the new tokens
    if tree_mask is None:
        new = rel[:, None, :] <= torch.arange(width)[None, :, None]  # [B, T, keys]
    else:
        index = rel.clamp(0, width - 1)[:, None, :].expand(-1, width, -1)  # [B, T, keys]
        new = torch.gather(tree_mask, 2, index) & (rel < width)[:, None, :]
    return (rel < 0)[:, None, :] | new


@dataclass(frozen=True)
class SlotGrowth:
    """How a KVCache's buffers follow the rows' lengths: `step` slots at a time, up to `limit` (the
    widest past a call may pass). Widening copies the valid slots once per `step` new positions of the
    longest row; every call then reads at most step - 1 slots more than its rows need. A buffer more
    than `shrink_after` steps wider than the rows need (a long request ended) is narrowed."""
    step: int
    limit: int
    shrink_after: int = 4

    def fit(self, needed: int, slots: int) -> int:
        if needed > self.limit:
            raise LoopspecError(f"a past of {needed} slots exceeds the engines' widest ({self.limit})")
        wanted = min(-(-needed // self.step) * self.step, self.limit)
        if wanted > slots or slots - wanted >= self.shrink_after * self.step:
            return wanted
        return slots


class KVCache:
    """Static K/V buffers [layers, rows, kv_heads, max_length, head_dim] for up to `rows` sequences,
    each with its own length (`lengths` [rows], on the host). Rolling back is lowering a length.

    The one cache type: the target's KV cache and the drafter's context are both one of these, on
    every backend. Callers keep their live rows packed at the front (`swap_rows` fills a hole), so
    a call over rows 0..B-1 reads a view, not a copy."""

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 growth: "SlotGrowth | None" = None):
        """growth None: the buffers hold max_length slots from the start, at fixed addresses (what a
        captured CUDA graph reads). With a SlotGrowth they hold as many slots as the rows need,
        rounded up to its step, and are reallocated when that changes (`dense_prefix`)."""
        self.growth = growth
        slots = max_length if growth is None else growth.step
        shape = (num_layers, rows, num_kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.lengths = torch.zeros(rows, dtype=torch.long)

    @property
    def slots(self) -> int:
        """How many slots the buffers hold per row: max_length, or what the rows need (`growth`)."""
        return self.k.shape[3]

    def _fit(self, needed: int) -> None:
        """With `growth`: reallocate the buffers to growth.fit(needed, slots) slots, keeping every
        row's valid slots; the slots past them start at zero (finite, as a masked slot must be)."""
        if self.growth is None:
            return
        slots = self.growth.fit(max(needed, int(self.lengths.max())), self.slots)
        if slots == self.slots:
            return
        keep = int(self.lengths.max())
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (slots,) + old.shape[4:])
            new[:, :, :, :keep] = old[:, :, :, :keep]
            setattr(self, name, new)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor, rows: list[int] | None = None,
               counts: torch.Tensor | list[int] | None = None) -> None:
        """Every layer at once: the first counts[i] entries of k/v [N, R, kvh, T, hd] row i go to cache
        row rows[i] (default i) at its length, which advances by counts[i] (default T)."""
        R, T = k.shape[1], k.shape[3]
        rows = torch.arange(R) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        counts = torch.full((R,), T) if counts is None else torch.as_tensor(counts, dtype=torch.long)
        starts = self.lengths[rows]
        if int((starts + counts).max()) > self.max_length:
            raise LoopspecError(f"sequence of {int((starts + counts).max())} exceeds the context of {self.max_length}")
        if int((starts + counts).max()) > self.slots:
            self._fit(int((starts + counts).max()))
        first, s = int(rows[0]), one_block(starts, counts, T)
        if s is not None and rows.tolist() == list(range(first, first + R)):  # one block of slots: a slice
            self.k[:, first:first + R, :, s:s + T] = k
            self.v[:, first:first + R, :, s:s + T] = v
            self.lengths[rows] = starts + counts
            return
        i, t = (torch.arange(T)[None, :] < counts[:, None]).nonzero(as_tuple=True)  # valid (row, token) pairs
        dev = self.k.device
        slots, dest, i, t = (starts[i] + t).to(dev), rows[i].to(dev), i.to(dev), t.to(dev)
        self.k[:, dest, :, slots] = k[:, i, :, t].to(self.k.dtype)  # [P, N, kvh, hd] on both sides
        self.v[:, dest, :, slots] = v[:, i, :, t].to(self.v.dtype)
        self.lengths[rows] = starts + counts

    def rollback(self, lengths: list[int] | torch.Tensor, rows: list[int] | None = None) -> None:
        """Rows `rows` (default 0..len(lengths)-1) keep their first lengths[i] slots."""
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        rows = torch.arange(lengths.numel()) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        if bool((lengths < 0).any()) or bool((lengths > self.lengths[rows]).any()):
            raise ValueError(f"cannot roll a row forward (or below 0): rows {rows.tolist()} of lengths "
                             f"{self.lengths[rows].tolist()} to {lengths.tolist()}")
        self.lengths[rows] = lengths

    def commit(self, starts: list[int], kept: list[list[int]]) -> None:
        """Rows 0..B-1 keep, of the tokens last stored from starts[b] on, those at offsets kept[b]
        (ascending, from 0: a draft tree's accepted path), moved to slots starts[b], starts[b] + 1, …;
        the rest is rolled back. A prefix (the chain) moves nothing."""
        for b, (start, offsets) in enumerate(zip(starts, kept)):
            if offsets != list(range(len(offsets))):
                src = torch.tensor(offsets, device=self.k.device) + start
                dst = torch.arange(len(offsets), device=self.k.device) + start
                self.k[:, b, :, dst] = self.k[:, b, :, src]  # the gather reads before the scatter writes
                self.v[:, b, :, dst] = self.v[:, b, :, src]
        self.rollback([s + len(o) for s, o in zip(starts, kept)])

    def prefix(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `width` slots of `rows` → K, V [layers, R, kvh, width, hd] (a view for rows that
        follow each other); slots past the buffer (room asked for beyond the max length) are zeros."""
        first = rows[0]
        if rows == list(range(first, first + len(rows))):
            k, v = self.k[:, first:first + len(rows), :, :width], self.v[:, first:first + len(rows), :, :width]
        else:
            index = torch.tensor(rows, device=self.k.device)
            k, v = self.k[:, index, :, :width], self.v[:, index, :, :width]
        if width > self.slots:
            pad = [0, 0, 0, width - self.slots]  # hd, then the slots
            k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
        return k, v

    def dense_prefix(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """At least the first `width` slots of `rows`, K, V [layers, R, kvh, W >= width, hd]. With
        `growth` the buffers are first fitted to the rows and W is all of their slots, so each layer
        of rows that follow each other is one contiguous block: a call passes the cache itself, not a
        copy of it (a copy of the whole past every call: 4.6 ms of a 31 ms step at 1024 positions).
        Slots past a row's length hold anything finite; a call masks them."""
        if self.growth is None:
            return self.prefix(rows, width)
        self._fit(width)
        return self.prefix(rows, self.slots)

    def swap_rows(self, a: int, b: int) -> None:
        """Rows a and b exchange their slots and lengths (only the valid slots are copied)."""
        n, pair = int(self.lengths[[a, b]].max()), [b, a]
        self.k[:, [a, b], :, :n] = self.k[:, pair, :, :n]  # the gather copies before the write
        self.v[:, [a, b], :, :n] = self.v[:, pair, :, :n]
        self.lengths[[a, b]] = self.lengths[pair]

    def plan(self, first_row: int, counts: torch.Tensor, width: int) -> KVWrite:
        """The write of one forward over rows first_row.. (counts [R] real tokens each, right-padded
        to `width`): real tokens go at each row's length; padding is never stored."""
        R = counts.shape[0]
        rows = slice(first_row, first_row + R)
        starts = self.lengths[rows]
        keys = int((starts + counts).max())
        if keys > self.max_length:
            raise LoopspecError(f"sequence of {keys} tokens exceeds the context of {self.max_length}")
        start = one_block(starts, counts, width)
        if start is not None:
            return KVWrite(rows, keys, start=start)
        row_index, token_index = (torch.arange(width)[None, :] < counts[:, None]).nonzero(as_tuple=True)
        dev = self.k.device
        return KVWrite(rows, keys, slots=(starts[row_index] + token_index).to(dev), row_index=row_index.to(dev),
                       token_index=token_index.to(dev))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, write: KVWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new k, v [R, kvh, T, hd] as `write` says → the keys/values its queries
        attend to, [R, kvh, write.keys, hd] (masked per query by the caller)."""
        cache_k, cache_v = self.k[layer, write.rows], self.v[layer, write.rows]  # views [R, kvh, S, hd]
        if write.start is not None:
            cache_k[:, :, write.start:write.start + k.shape[2]] = k
            cache_v[:, :, write.start:write.start + k.shape[2]] = v
        elif write.row_index is None:
            cache_k.index_copy_(2, write.slots, k)
            cache_v.index_copy_(2, write.slots, v)
        else:
            cache_k[write.row_index, :, write.slots] = k[write.row_index, :, write.token_index]  # [P, kvh, hd]
            cache_v[write.row_index, :, write.slots] = v[write.row_index, :, write.token_index]
        return cache_k[:, :, :write.keys], cache_v[:, :, :write.keys]


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

    def forward(self, x, cos, sin, cache: KVCache, write: KVWrite, layer: int, mask):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, T, hd]
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvh, T, hd]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.store(layer, k, v, write)  # [B, kvh, S, hd]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TargetAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache, write, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, write, layer, mask)
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

    def new_cache(self, max_length: int, rows: int = 1) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg.num_layers, rows, self.cfg.num_kv_heads,
                       min(max_length, self.cfg.max_position_embeddings), self.cfg.head_dim,
                       dtype=p.dtype, device=p.device)

    @torch.no_grad()  # not inference_mode: taps feed drafter training, whose autograd must save them
    def forward(self, input_ids: torch.Tensor, cache: KVCache, want_taps: bool = True,
                last_logits_only: bool = False, first_row: int = 0,
                counts: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """Rows first_row.. of `cache`, each after its own length: row b runs its first counts[b]
        tokens of `input_ids` [B, T] (right-padded; counts a host tensor [B], default all T) and
        advances by counts[b]. Row b's outputs equal those of running its tokens alone (fp32
        summation order aside); padding outputs are junk. last_logits_only: each row's last real
        position only ([B, 1, V]).

        tree_mask (host bool [B, T, T], default the causal chain): which of the new tokens each new
        token sees — a draft tree's ancestor mask (loopspec.tree.tree_masks). Token t then sits at
        position length + depth(t), its depth being the number of ancestors it sees; its K/V are
        stored at slot length + t all the same (the commit moves the accepted path into place)."""
        B, T = input_ids.shape
        counts = torch.full((B,), T) if counts is None else counts
        write = cache.plan(first_row, counts, T)
        dev = input_ids.device
        starts = cache.lengths[write.rows]
        offsets = torch.arange(T)[None, :] if tree_mask is None else tree_mask.sum(-1) - 1  # [B or 1, T]
        positions = starts[:, None] + offsets  # [B, T]
        cos, sin = self.rotary(positions.clamp_max(cache.max_length - 1).to(dev))  # padding may run past the end
        mask = None  # one query per row at one length sees every slot up to itself: no mask needed
        if T > 1 or write.start is None or tree_mask is not None:
            mask = attention_mask(starts, T, write.keys, tree_mask)[:, None].to(dev)  # [B, 1, T, keys]
        last = (counts - 1).to(dev) if last_logits_only else None
        out = self._stack(self.embed_tokens(input_ids), cos[:, None], sin[:, None], cache, write, mask, want_taps,
                          last)
        cache.lengths[write.rows] = starts + counts
        return out

    def _stack(self, x, cos, sin, cache: KVCache, write: KVWrite, mask, want_taps: bool,
               last_index: torch.Tensor | None) -> TargetOutput:
        """The decoder layers, final norm and lm_head over embeddings x [B, T, H]; logits at every
        position, or only at each row's `last_index` [B]."""
        tapped = set(self.target_layer_ids) if want_taps else set()
        taps: dict[int, torch.Tensor] = {}
        last = self.cfg.num_layers - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, write, i, mask)
            if i in tapped:
                taps[i] = x
        x = self.norm(x)
        if last in tapped:
            taps[last] = x  # HF's hidden_states[L] is the final-normed output; keep that meaning
        logits = self.lm_head(x if last_index is None else x[torch.arange(x.shape[0]), last_index][:, None])
        tap_tensor = torch.cat([taps[i] for i in self.target_layer_ids], dim=-1) if taps else None
        return TargetOutput(logits=logits, taps=tap_tensor)
