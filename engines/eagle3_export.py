"""Export wrappers of an EAGLE-3 drafter (loopspec/model/eagle3.py): `nn.Module`s that compute exactly
what engines/eagle3_specs.py declares, in the plain ops of engines/export.py and with its helpers
(`row_layout`, `attend` and its order-free softmax, `qkv_heads`, `swiglu`, `rms_norm`), so a row's
step computes, bit for bit, what it computes alone, whatever the other rows' lengths.

They compute what the torch engine's EAGLE-3 path computes (engines/eagle3_context.py over
`Eagle3Drafter.forward` / `.logits`): one decoder layer over [input_layernorm(embed(token)) ;
hidden_norm(state)], the residual the state itself (or hidden_norm(state) with norm_before_residual),
the output before the final norm (after it with norm_output) fed back as the next step's state, and
the drafts of `draft_candidates` over the drafter's own lm_head rows, mapped to target ids by d2t.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.engines.eagle3_specs import EAGLE3_FUSE, EAGLE3_STEP, eagle3_engine_specs
from loopspec.engines.export import (
    EXAMPLE_SIZES,
    TargetVerify,
    attend,
    example_inputs,
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
from loopspec.engines.specs import TARGET_VERIFY, EngineSpec
from loopspec.model.draft_head import draft_candidates
from loopspec.model.eagle3 import Eagle3Drafter
from loopspec.model.target import Target
from loopspec.weights import file_sha256


class Eagle3Fuse(nn.Module):
    """taps [B, T, 3·H_target] → states fc(taps) [B, T, H] (the taps normed first where the checkpoint
    says: one norm over the three with norm_before_fc, one per tap with fc_norm)."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, taps):
        d = self.drafter
        if d.input_norm is not None:
            taps = rms_norm(taps, d.input_norm.weight, d.input_norm.eps)
        if d.fc_norm is not None:
            taps = torch.cat(
                [
                    rms_norm(tap, norm.weight, norm.eps)
                    for norm, tap in zip(d.fc_norm, taps.chunk(len(d.fc_norm), dim=-1))
                ],
                dim=-1,
            )
        return linear(taps, d.fc)


class Eagle3Step(nn.Module):
    """(token_ids [B, T], states [B, T, H], positions [B, T], context_key/context_value [B, kvh, C, hd]
    (C >= every row's length + T), context_lengths [B], logit_index [B]) → draft_ids [B, n] (target
    ids, rank 0 the argmax), draft_logprobs [B, n], state [B, H] (the state the next step reads, at
    each row's logit_index), new_key/new_value [B, kvh, T, hd]."""

    def __init__(self, drafter: Eagle3Drafter, embed_weight: torch.Tensor):
        super().__init__()
        self.drafter = drafter
        cfg = drafter.cfg
        layer = drafter.midlayer
        self.register_buffer("embed_weight", embed_weight.detach())
        self.qkv_proj = fused_linear([layer.q_proj, layer.k_proj, layer.v_proj])  # [(h + 2kvh)·hd, 2H]
        # the torch drafter's own cos/sin (computed in fp64, cast), looked up by position
        cos, sin = drafter.rope(torch.arange(cfg.max_position_embeddings)[None], torch.float32)  # [1, 1, P, hd]
        self.register_buffer("cos", cos[0, 0].detach().clone())
        self.register_buffer("sin", sin[0, 0].detach().clone())
        self.register_buffer("rotate", rotate_half_matrix(cfg.head_dim))
        self.register_buffer("head_scale", head_scales(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        self.register_buffer("draft_to_target", drafter.draft_ids.clone() if drafter.draft_ids is not None else None)

    def forward(self, token_ids, states, positions, context_key, context_value, context_lengths, logit_index):
        d, cfg, layer = self.drafter, self.drafter.cfg, self.drafter.midlayer
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        batch, width = token_ids.shape[0], context_key.shape[2]
        cos = self.cos[positions][:, :, None] * self.head_scale  # [B, T, h + kvh, hd]: q pre-scaled
        sin = self.sin[positions][:, :, None] * self.head_scale
        order = torch.cumsum(torch.ones_like(token_ids[0]), 0)  # [T]: 1..T
        causal = (order[None, :] <= order[:, None])[None].expand(batch, -1, -1)  # [B, T, T]: entry i sees j <= i
        slots, mask = row_layout(context_lengths, width, causal, kvh, h // kvh, hd)
        normed = rms_norm(states, layer.hidden_norm.weight, layer.hidden_norm.eps)  # [B, T, H]
        residual = normed if cfg.variant.norm_before_residual else states
        embeds = F.embedding(token_ids, self.embed_weight)
        x = torch.cat([rms_norm(embeds, layer.input_layernorm.weight, layer.input_layernorm.eps), normed], dim=-1)
        q, k, v = qkv_heads(linear(x, self.qkv_proj), batch, h, kvh, hd, None, 0.0, cos, sin, self.rotate)
        out = attend(q, context_key, context_value, k, v, slots, mask)
        x = residual + linear(merge_heads(out, batch, h, hd), layer.o_proj)
        x = x + swiglu(
            rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps), layer.mlp
        )  # [B, T, H]: the states the next steps take
        state = x.gather(1, logit_index[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]  # [B, H]
        final = rms_norm(state, d.norm.weight, d.norm.eps)  # [B, H]
        logits = linear(final, d.lm_head)  # [B, Vd]
        drafts, logprobs = draft_candidates(logits, self.draft_to_target)
        # the state the next step reads: the output before the final norm, or with norm_output (EAGLE 3.1) after it
        return drafts, logprobs, final if cfg.variant.norm_output else state, k, v


def step_example(spec: EngineSpec, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """Valid eagle3_step inputs of the example sizes: ids in the vocabulary, rows of different
    context lengths (each with room for the entries), each row's logit index inside its entries."""
    args = dict(zip(spec.input_names, example_inputs(spec, vocab_size)))
    batch, tokens, context = (EXAMPLE_SIZES[d] for d in ("batch", "tokens", "context"))
    g = torch.Generator().manual_seed(1)
    args["token_ids"] = torch.randint(0, vocab_size, (batch, tokens), generator=g)
    args["context_lengths"] = (context - tokens) - torch.arange(batch) % (context - tokens + 1)
    args["positions"] = args["context_lengths"][:, None] + torch.arange(tokens)
    args["logit_index"] = torch.arange(batch) % tokens
    return tuple(args[name] for name in spec.input_names)


def eagle3_engines(
    target: Target,
    drafter: Eagle3Drafter,
    *,
    max_context: int,
    block_size: int | None,
    max_batch: int,
    verify_target: Target | None = None,
) -> tuple[dict[str, EngineSpec], dict[str, nn.Module], dict[str, tuple]]:
    """The specs, export modules and the example inputs they need beside `example_inputs`' of a target
    with an EAGLE-3 drafter (engines/export.py exports them): target_verify with the drafter's three
    taps, eagle3_fuse and eagle3_step (the drafter's own embedding when it carries one, else the target's)."""
    specs = eagle3_engine_specs(
        target.cfg, drafter.cfg, max_context=max_context, block_size=block_size, max_batch=max_batch
    )
    embed = drafter.embed_tokens if drafter.embed_tokens is not None else target.embed_tokens
    modules = {
        TARGET_VERIFY: TargetVerify(
            verify_target if verify_target is not None else target, drafter.cfg.target_layer_ids
        ),
        EAGLE3_FUSE: Eagle3Fuse(drafter),
        EAGLE3_STEP: Eagle3Step(drafter, embed.weight),
    }
    return specs, modules, {EAGLE3_STEP: step_example(specs[EAGLE3_STEP], target.cfg.vocab_size)}


def eagle3_code_sha256() -> str:
    """The EAGLE-3 graphs' own source (wrappers, specs, the drafter model): a cached export made by
    other code is not reused."""
    from loopspec.engines import eagle3_specs
    from loopspec.model import draft_head, eagle3

    h = hashlib.sha256()
    for source in (Path(__file__), Path(eagle3_specs.__file__), Path(eagle3.__file__), Path(draft_head.__file__)):
        h.update(file_sha256(source).encode())
    return h.hexdigest()
