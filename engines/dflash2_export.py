"""The drafter_block graph of a DFlash2 drafter (loopspec/model/dflash2.py): the same inputs and outputs
as every block drafter's (engines/specs.py `drafter_block_spec`), computed in plain ONNX ops.

What it adds to DFlash's block (engines/export.py `DrafterBlock`):
- around each sublayer the grouped dynamic causal convolution: Pad + Slice for the shifted block (zeros
  before its first slot), one product with the projected coefficients per tap, summed tap by tap in
  the order the torch module sums them;
- each layer's own mask: its window (|query position - key position| < window, a context slot j at
  position j, the block's slots at their positions) and, where the config makes the block causal, the
  block's own keys up to the query's;
- the candidate selector: the target head's top-k per slot (TopK), then the walk from the anchor
  unrolled over the most slots a block of `max_block` has. The walk reads, at each slot, the token it
  chose at the slot before (ArgMax, ties to the higher-ranked candidate, as the torch engine's stable
  sort), so a slot past this call's block changes nothing before it: the states are padded to that
  width and the outputs cut back (as a DSpark drafter's Markov chain, `unrolled_draft_head`).

Outputs, as the torch engine's `selector_stage` without sampling: each slot's candidates ranked by
their scores given the walk's own predecessor (rank 0 is the walk), the log-softmax of those scores,
and the final-norm block states. Every op is per row (no product mixes rows), so a row computes in any
batch what it computes alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.engines.graph_ops import (
    attend,
    fixed_linear,
    fused_linear,
    head_scales,
    linear,
    merge_heads,
    qkv_heads,
    rms_norm,
    rotate_half_matrix,
    row_layout,
    swiglu,
)
from loopspec.model.dflash2 import DFlash2Drafter
from loopspec.model.draft_head import DRAFT_CANDIDATES


def causal_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [B, T, H], dynamic [B, T, taps, G], base [taps, H] → y [B, T, H] with
    y[t] = Σ_o (base[o] + dynamic[t, o] over its group's channels) ⊙ x[t - o], zeros before slot 0
    (model/dflash2.py `grouped_dynamic_conv`). T stays symbolic: a tap past the block's start reads the
    padding only."""
    batch, hidden = x.shape[0], x.shape[2]
    taps, groups = base.shape[0], hidden // group_size
    blocks = x.reshape(batch, -1, groups, group_size)  # [B, T, G, gs]
    out = None
    for offset in range(taps):
        shifted = blocks if offset == 0 else F.pad(blocks, (0, 0, 0, 0, offset, 0))[:, :-offset]  # x[t - offset]
        term = (base[offset].reshape(1, 1, groups, group_size) + dynamic[:, :, offset, :, None]) * shifted
        out = term if out is None else out + term
    return out.reshape(batch, -1, hidden)


def walk_choice(score: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The token the walk takes at a slot: the candidate [B, K] of the best score [B, K] (ArgMax: the
    first of equal scores, the higher-ranked candidate) → [B]; the next slot's predecessor."""
    return candidates.gather(-1, score.argmax(-1, keepdim=True))[:, 0]


class DFlash2Block(nn.Module):
    """(block_ids [B, k], positions [B, k], context_key/context_value [N, B, kvh, C, hd],
    context_lengths [B]) → draft_ids [B, k-1, c] (the selector's ranked candidates as target ids, rank
    0 the walk), draft_logprobs [B, k-1, c], hidden [B, k, H]; c = min(8, selector_top_k).

    Takes what `DrafterBlock` takes: the target's embedding, its lm_head (or `head`, a module over the
    head's rows that exports itself), and the widest block the graph unrolls the walk for."""

    def __init__(
        self,
        drafter: DFlash2Drafter,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        max_block: int | None = None,
        head: nn.Module | None = None,
    ):
        super().__init__()
        self.drafter = drafter
        cfg = drafter.cfg
        self.max_block = max_block or cfg.block_size
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.register_buffer("embed_weight", embed_weight.detach())
        self.head = head if head is not None else fixed_linear(lm_head_weight.detach())  # DFlash2: the whole vocabulary
        self.qkv_proj = nn.ModuleList(
            fused_linear([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in drafter.layers
        )
        self.register_buffer(
            "qk_norm_weight",
            torch.stack(
                [
                    torch.cat(
                        [
                            l.self_attn.q_norm.weight.detach().expand(h, hd),
                            l.self_attn.k_norm.weight.detach().expand(kvh, hd),
                        ]
                    )
                    for l in drafter.layers
                ]
            ),
        )  # [N, h + kvh, hd]
        self.register_buffer("rotate", rotate_half_matrix(hd))
        self.register_buffer("head_scale", head_scales(h, kvh, hd))
        # per layer (window, causal): layers that share a rule share one mask
        self.rules = [(cfg.layer_window(i), cfg.layer_causal(i)) for i in range(cfg.num_layers)]
        self.candidates = min(DRAFT_CANDIDATES, cfg.selector_top_k)

    def layer_masks(self, positions, context_lengths, width: int) -> tuple[torch.Tensor, dict]:
        """The new K/V's slots [B, kvh, k, hd] and {rule: additive mask [B, 1, g·k, width]}: a row's
        valid context and the block, within the rule's window and, causal, the block's keys up to the
        query's (`row_layout` places the block right after each row's own context)."""
        cfg = self.drafter.cfg
        kvh, group, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        ones = torch.ones_like(positions, dtype=torch.bool)
        every = ones[:, :, None] & ones[:, None, :]  # [B, k, k]
        up_to_own = positions[:, None, :] <= positions[:, :, None]  # [B, k, k]: the block's slots are consecutive
        masks, slots = {}, None
        for window, causal in self.rules:
            if (window, causal) in masks:
                continue
            slots, mask = row_layout(context_lengths, width, up_to_own if causal else every, kvh, group, hd)
            if window is not None:
                slot = torch.arange(width, device=positions.device)[None, :]  # [1, W]
                offset = slot - context_lengths[:, None]  # [B, W]: slot - length
                block_slot = offset.clamp(0, positions.shape[1] - 1)
                key_positions = torch.where(offset < 0, slot, positions.gather(1, block_slot))  # [B, W]
                far = (positions[:, :, None] - key_positions[:, None, :]).abs() >= window  # [B, k, W]
                mask = mask + torch.where(far, float("-inf"), 0.0)[:, None].repeat(
                    1, 1, group, 1
                )  # rows in (g, k) order
            masks[(window, causal)] = mask
        return slots, masks

    def forward(self, block_ids, positions, context_key, context_value, context_lengths):
        d, cfg = self.drafter, self.drafter.cfg
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        batch, width = block_ids.shape[0], context_key.shape[3]
        cos = d.rotary.cos[positions][:, :, None] * self.head_scale  # [B, k, h + kvh, hd]
        sin = d.rotary.sin[positions][:, :, None] * self.head_scale
        slots, masks = self.layer_masks(positions, context_lengths, width)
        x = F.embedding(block_ids, self.embed_weight)  # [B, k, H]
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        for i, layer in enumerate(d.layers):
            attn, convs = layer.self_attn, (layer.attention_conv, layer.mlp_conv)
            # around attention: its queries and the block's own K/V read the convolved normed states
            y, dynamic = self.prepare(convs[0], rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps))
            q, k, v = qkv_heads(
                linear(y, self.qkv_proj[i]),
                batch,
                h,
                kvh,
                hd,
                self.qk_norm_weight[i],
                attn.q_norm.eps,
                cos,
                sin,
                self.rotate,
            )
            out = attend(q, context_key[i], context_value[i], k, v, slots, masks[self.rules[i]])
            x = x + self.finish(convs[0], linear(merge_heads(out, batch, h, hd), attn.o_proj), dynamic)
            y, dynamic = self.prepare(
                convs[1], rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            )
            x = x + self.finish(convs[1], swiglu(y, layer.mlp), dynamic)
        hidden = rms_norm(x, d.norm.weight, d.norm.eps)  # [B, k, H]
        drafts, logprobs = self.select(hidden, block_ids[:, 0])
        return drafts, logprobs, hidden  # [B, D, c], [B, D, c], [B, k, H]

    @staticmethod
    def prepare(conv: nn.Module, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`GroupedDynamicConv.prepare`: the first convolution of normed [B, k, H], and the coefficients
        [B, k, taps, G] of the second (both projected from the normed states, per token)."""
        dynamic = linear(normed, conv.kernel_projection).reshape(normed.shape[0], -1, 2, conv.taps, conv.groups)
        return causal_dynamic_conv(normed, dynamic[:, :, 0], conv.base_kernel[0], conv.group_size), dynamic[:, :, 1]

    @staticmethod
    def finish(conv: nn.Module, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return causal_dynamic_conv(y, dynamic, conv.base_kernel[1], conv.group_size)

    def select(self, hidden: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's walk over hidden [B, k, H]'s drafting slots 1..k-1 from the anchors [B] →
        ranked candidates and their log-probs [B, k-1, c] (model/dflash2.py `selector_stage`)."""
        d, cfg = self.drafter, self.drafter.cfg
        selector = d.candidate_selector
        states = hidden[:, cfg.first_draft :]  # [B, D, H]
        slots = self.max_block - cfg.first_draft  # the walk is unrolled over this many; the last real state repeats
        states = torch.cat([states, states[:, -1:].expand(-1, slots, -1)], dim=1)[:, :slots]  # [B, slots, H]
        logits = linear(states, self.head)  # [B, slots, V]
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        unary, candidates = logits.topk(cfg.selector_top_k, dim=-1)  # [B, slots, K], descending
        projected = linear(states, selector.hidden_projection)  # [B, slots, rank]
        successors = F.embedding(candidates, selector.successor_codebook)  # [B, slots, K, rank]
        previous, chosen_scores = anchors, []
        for i in range(slots):
            gated = F.embedding(previous, selector.predecessor_codebook) * projected[:, i]  # [B, rank]
            score = unary[:, i] + (gated[:, None, :] * successors[:, i]).sum(-1)  # [B, K]
            previous = walk_choice(score, candidates[:, i])  # [B]
            chosen_scores.append(score)
        drafting = hidden.shape[1] - cfg.first_draft  # D of this call's block
        scores = torch.stack(chosen_scores, dim=1)[:, :drafting]  # [B, D, K]
        order = scores.topk(self.candidates, dim=-1).indices  # [B, D, c]: rank 0 the walk's choice
        drafts = candidates[:, :drafting].gather(-1, order)
        return drafts, torch.log_softmax(scores, dim=-1).gather(-1, order)
