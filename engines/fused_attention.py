"""The target graph's attention as ONE node: ONNX Runtime's GroupQueryAttention (com.microsoft).

The order-free attention of engines/export.py is ~25 small nodes a layer (rotary, a scatter of the
new K/V into a copy of the past, the scores, an integer-summed softmax, the values); on a small model
their dispatch costs more than the layer's matrix products. GroupQueryAttention does the same work in
one kernel: the packed q/k/v projection in, rotary from each row's own length, the past copied with
the new K/V appended at each row's length (`present`), and per row and head a causal softmax over
exactly that row's `length + i + 1` keys.

What stays exact, and why: a row's token i sees its row's keys 0 .. length + i at the same slots
whether it runs alone or in a verification of several tokens (the kernel's softmax covers just
those keys; the value product adds exact zeros after them), and rows never mix. So a chain
verification computes what plain decoding computes, and any batch what each row computes alone
(both checked by the identity tests). A draft tree does not: a node's ancestors would sit at other
slots than in plain decoding, with its masked siblings between them, and the kernel's softmax sums
lanes in slot order. An engine with this attention verifies chains only (the manifest says so and the
runtime refuses trees in one line).
"""

from __future__ import annotations

import math

import torch

FUSED_ATTENTION = "GroupQueryAttention (one ONNX Runtime kernel a layer; verifies chains only)"
ORDER_FREE_ATTENTION = "order-free (a node's keys at any slots: verifies draft trees)"
ATTENTIONS = {"order-free": ORDER_FREE_ATTENTION, "fused": FUSED_ATTENTION}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, T, heads, hd]; cos/sin [B, T, 1, hd/2] (rotate-half convention of HF)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _GroupQueryAttention(torch.autograd.Function):
    """qkv [B, T, (h + 2kvh)·hd], past_key/past_value [B, kvh, W, hd] (row b's first lengths[b] slots
    valid), seqlens_k [B] int32 (= lengths + T - 1), total_length int32 scalar (= max lengths + T),
    cos_cache/sin_cache [P, hd/2] → out [B, T, h·hd], present_key/present_value [B, kvh, total, hd].
    The forward is the reference the exporter traces; ONNX Runtime runs the kernel."""

    @staticmethod
    def forward(ctx, qkv, past_key, past_value, seqlens_k, total_length, cos_cache, sin_cache, positions,
                num_heads: int, num_kv_heads: int, scale: float):
        batch, tokens, _ = qkv.shape
        hd = past_key.shape[-1]
        q, k, v = qkv.view(batch, tokens, num_heads + 2 * num_kv_heads, hd).split(
            [num_heads, num_kv_heads, num_kv_heads], dim=2)
        starts = seqlens_k.long() + 1 - tokens  # [B]: each row's past length
        slots = starts[:, None] + torch.arange(tokens)[None, :]  # [B, T]
        cos, sin = cos_cache[positions][:, :, None], sin_cache[positions][:, :, None]  # [B, T, 1, hd/2]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        total = int(total_length)
        present_key = past_key.new_zeros(batch, num_kv_heads, total, hd)
        present_value = past_value.new_zeros(batch, num_kv_heads, total, hd)
        keep = min(total, past_key.shape[2])
        present_key[:, :, :keep] = past_key[:, :, :keep]
        present_value[:, :, :keep] = past_value[:, :, :keep]
        index = slots[:, None, :, None].expand(batch, num_kv_heads, tokens, hd)  # [B, kvh, T, hd]
        present_key = present_key.scatter(2, index, k.transpose(1, 2))
        present_value = present_value.scatter(2, index, v.transpose(1, 2))
        group = num_heads // num_kv_heads
        keys = present_key.repeat_interleave(group, dim=1)  # [B, h, total, hd]
        values = present_value.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2)) * scale  # [B, h, T, total]
        visible = torch.arange(total)[None, None, :] <= slots[:, :, None]  # [B, T, total]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, h, T, hd]
        return out.transpose(1, 2).reshape(batch, tokens, num_heads * hd), present_key, present_value

    @staticmethod
    def symbolic(g, qkv, past_key, past_value, seqlens_k, total_length, cos_cache, sin_cache, positions,
                 num_heads: int, num_kv_heads: int, scale: float):
        from torch.onnx.symbolic_helper import _optional_input_placeholder_tensor

        absent = _optional_input_placeholder_tensor(g)
        out, present_key, present_value = g.op(
            "com.microsoft::GroupQueryAttention", qkv, absent, absent, past_key, past_value, seqlens_k,
            total_length, cos_cache, sin_cache, positions, num_heads_i=num_heads, kv_num_heads_i=num_kv_heads,
            do_rotary_i=1, rotary_interleaved_i=0, scale_f=scale, outputs=3)
        sizes = qkv.type().varyingSizes()
        if sizes is not None:
            hd = past_key.type().varyingSizes()[-1]
            out.setType(qkv.type().with_sizes(sizes[:-1] + [num_heads * hd]))
        past_sizes = past_key.type().varyingSizes()
        if past_sizes is not None:
            for present in (present_key, present_value):
                present.setType(past_key.type().with_sizes(past_sizes[:2] + [None] + past_sizes[3:]))
        return out, present_key, present_value


class FusedAttention(torch.nn.Module):
    """One layer's attention over the packed projection; the new K/V read back at each row's slots."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        half = head_dim // 2
        # the tables' halves are equal (HF's cat([freqs, freqs])): the kernel takes one half
        self.register_buffer("cos_cache", cos[:, :half].contiguous())  # [P, hd/2]
        self.register_buffer("sin_cache", sin[:, :half].contiguous())
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, qkv, past_key, past_value, seqlens_k, total_length, positions, slots):
        """qkv [B, T, (h + 2kvh)·hd] → out [B, T, h·hd], new key/value [B, kvh, T, hd] (`positions` [B, T]
        the rotary positions; `slots`: each row's length + arange(T), expanded to [B, kvh, T, hd])."""
        out, present_key, present_value = _GroupQueryAttention.apply(
            qkv, past_key, past_value, seqlens_k, total_length, self.cos_cache, self.sin_cache, positions,
            self.num_heads, self.num_kv_heads, self.scale)
        return out, present_key.gather(2, slots), present_value.gather(2, slots)
