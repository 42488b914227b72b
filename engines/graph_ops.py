"""The plain-op building blocks of the exported graphs (engines/export.py's wrappers and the DFlash2
block's, engines/dflash2_export.py): norms, RoPE, each row's slots and mask among a call's past, the
order-free softmax, attention over [past ; new], the fused products. Each maps onto standard ONNX
operators (Gather, MatMul, Softmax, Where, Concat, Reshape, ...); why they are written so (the KV
layout, batch invariance) is told in engines/export.py's docstring."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """R [hd, hd] with x @ R = cat(-x[hd/2:], x[:hd/2]) exactly (one ±1 per column): RoPE's rotate-half
    as ONE MatMul instead of Slice, Slice, Neg, Concat on every q/k."""
    half = head_dim // 2
    r = torch.zeros(head_dim, head_dim)
    r[torch.arange(half) + half, torch.arange(half)] = -1.0
    r[torch.arange(half), torch.arange(half) + half] = 1.0
    return r


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: torch.Tensor) -> torch.Tensor:
    # x [..., hd]; cos/sin broadcast to x (rotate-half convention of HF)
    return x * cos + torch.matmul(x, rotate) * sin


def row_layout(
    lengths: torch.Tensor, width: int, new_mask: torch.Tensor, num_kv_heads: int, group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's T new tokens go among the `width` slots of a call's past, and what each sees.

    The past comes with room: `width` >= every row's length + T. Row b's new tokens take slots
    lengths[b] .. lengths[b] + T - 1, right after its own valid past (not after the call's widest
    past), so every term of a row's attention sits at the index it has when the row runs alone: no
    masked gap between its past and its new tokens, and the products' sums group the same terms
    (ONNX Runtime's MatMul sums its reduction in blocks of 256). The slots past them are masked, at
    the end.

    lengths [B] valid past slots per row, new_mask bool [B, T, T] (new token i sees new token j) →
    slots [B, kvh, T, hd] (scatter index of the new K/V), additive mask [B, 1, g·T, width] (rows in
    q's (g, T) order)."""
    batch, tokens = new_mask.shape[0], new_mask.shape[1]
    offset = torch.arange(width, device=lengths.device)[None, :] - lengths[:, None]  # [B, W]: slot - length
    in_new = (offset >= 0) & (offset < tokens)
    sees_new = new_mask.gather(2, offset.clamp(0, tokens - 1)[:, None, :].expand(batch, tokens, -1))  # [B, T, W]
    visible = (offset < 0)[:, None, :] | (in_new[:, None, :] & sees_new)  # own past, and the new tokens it sees
    mask = torch.where(visible, 0.0, float("-inf"))[:, None].repeat(1, 1, group, 1)  # [B, 1, g·T, W]
    slots = lengths[:, None] + torch.arange(tokens, device=lengths.device)[None, :]  # [B, T]
    return slots[:, None, :, None].expand(batch, num_kv_heads, tokens, head_dim), mask


# integer units per 1.0 of the softmax's sum: 2^-40 resolution, exact int64 sums of up to 2^23 terms
SOFTMAX_SUM_UNITS = 2.0**40
ORDER_FREE_SOFTMAX = "order-free (exps summed as int64 units of 2^-40)"  # the manifest's name of it


def order_free_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim whose result does not depend on where the masked (-inf) slots sit or
    how wide the row is: the max is exact in any order and exp is elementwise, but a float sum rounds
    differently when elements move to other SIMD lanes (ONNX Runtime's softmax shifts every later
    element when a masked slot sits inside the row: a draft tree's siblings). So the exps are summed
    as integers (exact and associative) in units of 2^-40 — a relative error of the sum below 1e-9
    for any context — and each is divided by that sum."""
    exps = torch.exp(scores - scores.amax(-1, keepdim=True))  # masked slots: exactly 0
    units = exps * SOFTMAX_SUM_UNITS  # exact: a power of two
    total = units.to(torch.int64).sum(-1, keepdim=True)  # truncation is exact per element
    # units / total is exps / (total / 2^40) bit for bit (the same real quotient, rounded once), with
    # one pass over the scores fewer
    return units / total.to(scores.dtype)


def attend_with_keys(
    q: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped-query attention of q [B, kvh, g·T, hd] (pre-scaled; query head j = kv head j // g, as
    HF's repeat_kv) over each row's [valid past ; new] keys (`row_layout`: slots, mask) → [B, kvh, g·T, hd].
    past_k/past_v [B, kvh, W, hd] are the call's past with room for the new tokens (W >= every row's
    length + T; the slots past a row's length hold anything finite), k/v [B, kvh, T, hd].

    The new K/V are written into the room at each row's own length (one copy of the past each, no
    concatenation), and ONE product over those slots gives the scores, one the values: a token's
    output then depends neither on the other rows of the call nor on whether its context came from
    the cache or from the same call, so a verification computes bit for bit what plain decoding
    computes. The softmax is order-free and a masked slot's probability exactly 0 (adding 0·v is
    exact), so masked slots between a tree node's ancestors (its siblings) change nothing either, as
    long as the node's terms stay in the same 256-slot blocks of the value product as in plain
    decoding (the decoder keeps a tree inside one block)."""
    keys = past_k.scatter(2, slots, k)  # [B, kvh, W, hd]
    values = past_v.scatter(2, slots, v)
    scores = torch.matmul(q, keys.transpose(-1, -2)) + mask  # [B, kvh, g·T, W]
    return torch.matmul(order_free_softmax(scores), values), keys, values


def attend(q, past_k, past_v, k, v, slots, mask) -> torch.Tensor:
    """`attend_with_keys`' output alone (the drafter block's attention over its context)."""
    return attend_with_keys(q, past_k, past_v, k, v, slots, mask)[0]


def head_scales(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[h + kvh, 1]: the attention scale 1/sqrt(hd) on the query heads, 1 on the key heads; folded
    into the RoPE tables of the joint q/k tensor, so no separate scaling op per layer."""
    return torch.cat([torch.full((num_heads, 1), 1.0 / math.sqrt(head_dim)), torch.ones(num_kv_heads, 1)])


def qkv_heads(
    qkv: torch.Tensor,
    batch,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm_weight,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate: torch.Tensor,
):
    """The fused projection's output [B, T, (h + 2kvh)·hd] → q [B, kvh, g·T, hd] (scaled), k, v
    [B, kvh, T, hd]: q and k are normed (Qwen3) and rotated together as one [B, T, h + kvh, hd] tensor."""
    h, kvh, hd = num_heads, num_kv_heads, head_dim
    qk, v = qkv.reshape(batch, -1, h + 2 * kvh, hd).split([h + kvh, kvh], dim=2)
    if qk_norm_weight is not None:
        qk = rms_norm(qk, qk_norm_weight, eps)  # weight [h + kvh, hd]: q_norm rows, then k_norm rows
    qk = rope(qk, cos, sin, rotate).transpose(1, 2)  # [B, h + kvh, T, hd]
    q, k = qk.split([h, kvh], dim=1)
    return q.reshape(batch, kvh, -1, hd), k, v.transpose(1, 2)


def merge_heads(out: torch.Tensor, batch, num_heads: int, head_dim: int) -> torch.Tensor:
    # [B, kvh, g·T, hd] → [B, T, h·hd]
    return out.reshape(batch, num_heads, -1, head_dim).transpose(1, 2).reshape(batch, -1, num_heads * head_dim)


def linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    if getattr(module, "exports_itself", False):  # a quantized linear (convert/qdq.py) emits its own Q/DQ ops
        return module(x)
    return F.linear(x, module.weight, module.bias)


def fixed_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free, frozen linear over `weight` [N, K] (exported as an initializer)."""
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    module.weight = nn.Parameter(weight, requires_grad=False)
    return module


def fused_linear(parts: list[nn.Module]) -> nn.Module:
    """One bias-free linear whose output is the parts' outputs side by side (weights stacked by rows);
    quantized linears fuse themselves."""
    if getattr(parts[0], "exports_itself", False):
        return type(parts[0]).fused(parts)
    return fixed_linear(torch.cat([p.weight for p in parts]).detach().clone())


def swiglu(x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    gate, up = linear(x, mlp.gate_up_proj).split(mlp.intermediate, dim=-1)
    return linear(F.silu(gate) * up, mlp.down_proj)
