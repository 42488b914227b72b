"""DFlash block-diffusion drafter: z-lab's checkpoint format, and DeepSpec's DSpark / DFlash format.

One forward ("stage") drafts a whole block `[anchor, MASK × (k-1)]` at positions a .. a+k-1. Every
layer's queries come from the block only; its keys/values are `[context ; block]`, where the context
is the target's tapped hidden states projected by `fc` → `hidden_norm` and then by the layer's own
`k_proj`/`v_proj` (+ `k_norm`, RoPE at absolute positions). Inside the block attention is
bidirectional. The drafter has no embedding or lm_head of its own: it borrows the target's.

Which block outputs are drafts is the drafter's block convention (`DrafterConfig.anchor_predicts`):
z-lab's output at block position i (1..k-1) predicts the token AT position a+i (k-1 drafts);
DeepSpec's output at every position i (0..k-1) predicts the token at a+i+1 (k drafts).

A DSpark drafter adds a Markov head and / or a confidence head after the lm_head (dspark.py); the
draft-head step runs them (draft_head.py). What kind a drafter is (drafter_kinds.py) is what every
other layer asks of it: `DrafterConfig.kind`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.decoding import DraftSampler
from loopspec.errors import LoopspecError
from loopspec.files import one_line, read_json, read_safetensors, refuse_quantized, write_safetensors
from loopspec.model.draft_head import StageDrafts, draft_stage, sample_stage
from loopspec.model.drafter_kinds import (
    ARCHITECTURE,
    DEEPSPEC_ARCHITECTURE,
    MARKOV_HEAD_TYPES,
    DrafterKind,
    drafter_kind,
)
from loopspec.model.dspark import ConfidenceHead, DSparkHeads, MarkovHead
from loopspec.model.kv_cache import KVCache
from loopspec.model.target import MLP, RMSNorm, RotaryTable, TargetConfig, apply_rope, default_target_layer_ids

D2T_FILE = "d2t.safetensors"


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int | None
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    # the block convention: False = z-lab's (block position i >= 1 drafts the token at a+i: k-1
    # drafts), True = DeepSpec's (every position i drafts the token at a+i+1: k drafts)
    anchor_predicts: bool = False
    markov_rank: int = 0  # DSpark's low-rank Markov head (0: none)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence_head: bool = False  # DSpark's per-position acceptance estimate
    confidence_with_markov: bool = False  # the confidence head also reads W1[prev]
    extra: dict = field(default_factory=dict)  # loopspec settings kept beside the z-lab fields

    def __post_init__(self):
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise LoopspecError(
                f"unknown markov_head_type {self.markov_head_type!r} (choose from {', '.join(MARKOV_HEAD_TYPES)})"
            )
        if self.markov_rank < 0:
            raise LoopspecError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank > self.vocab_size:  # W1 [V, r] and W2 [r, V]: a larger rank adds nothing but memory
            raise LoopspecError(
                f"markov_rank {self.markov_rank} is larger than the vocabulary of {self.vocab_size}: "
                "a low-rank head's rank is at most the vocabulary size"
            )
        if self.confidence_with_markov and not (self.confidence_head and self.markov_rank):
            raise LoopspecError(
                "confidence_head_with_markov needs both a confidence head and a Markov head (markov_rank > 0)"
            )

    @property
    def kind(self) -> DrafterKind:
        """What this drafter is (its family, block convention and heads): what other layers ask."""
        return drafter_kind(self)

    def fit(self, target: TargetConfig) -> None:
        """Refuse a drafter that cannot run against `target`, naming what does not match."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab size {self.vocab_size} != target's {target.vocab_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(
                f"drafter was built for {self.num_target_layers} target layers, target has {target.num_layers}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"tap ids {bad} out of range for a target with {target.num_layers} layers")
        if self.mask_token_id is None:
            problems.append("no mask token id (set dflash_config.mask_token_id, or mask_token_id in a DeepSpec config)")
        elif not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask token id {self.mask_token_id} outside the vocabulary of {target.vocab_size}")
        if problems:
            raise LoopspecError("drafter does not fit the target: " + "; ".join(problems))

    @property
    def first_draft(self) -> int:
        """The first block position whose output is a draft (0: the anchor's own, DeepSpec's convention)."""
        return self.kind.convention.first_draft

    def drafts_per_block(self, block_size: int) -> int:
        """How many drafts one stage of `block_size` positions yields."""
        return self.kind.drafts_per_block(block_size)

    @property
    def is_dspark(self) -> bool:
        """Carries a head that runs after the lm_head (the Markov or confidence head)."""
        return bool(self.kind.heads)

    @classmethod
    def for_target(
        cls,
        target: TargetConfig,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
    ) -> "DrafterConfig":
        """A fresh drafter whose widths are all set explicitly from the target's."""
        if num_layers < 1:
            raise LoopspecError(f"a drafter needs at least one layer, got {num_layers}")
        if block_size < 2:
            raise LoopspecError(f"block size must be at least 2, got {block_size}")
        ids = (
            target_layer_ids
            if target_layer_ids is not None
            else default_target_layer_ids(target.num_layers, num_layers)
        )
        if not ids:
            raise LoopspecError("target_layer_ids must name at least one target layer")
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_layers,
            target_layer_ids=list(ids),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
        )

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def to_zlab(self) -> dict:
        """A Qwen3 config + the DFlash fields, as TensorRT-LLM / vLLM / SGLang read them. A drafter of
        DeepSpec's block convention is written as DeepSpec writes it (`Qwen3DSparkModel`, the fields at
        the top level, `dflash_config` too for readers that look there): a z-lab architecture name
        would make every z-lab reader draft one position off."""
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        cfg = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids},
        }
        heads = {"markov_rank": self.markov_rank, "enable_confidence_head": self.confidence_head}
        if self.markov_rank:
            heads["markov_head_type"] = self.markov_head_type
        if self.confidence_head:
            heads["confidence_head_with_markov"] = self.confidence_with_markov
        if self.anchor_predicts:
            cfg.update(
                {
                    "architectures": [DEEPSPEC_ARCHITECTURE],
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": self.target_layer_ids,
                    **heads,
                }
            )
        elif self.is_dspark:  # z-lab's convention with heads: the head fields beside the mask and taps
            cfg["dflash_config"].update(heads)
        if self.extra:
            cfg["loopspec"] = self.extra
        return cfg

    @classmethod
    def from_checkpoint(cls, cfg: dict) -> "DrafterConfig":
        """Read a drafter's config.json: z-lab's `DFlashDraftModel` (mask and taps in `dflash_config`),
        or DeepSpec's `Qwen3DSparkModel` (DSpark, or DFlash with markov_rank 0: the fields at the top
        level, DeepSpec's block convention)."""
        if not isinstance(cfg, dict):
            raise LoopspecError(f"drafter config.json must hold a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not ({ARCHITECTURE, DEEPSPEC_ARCHITECTURE} & set(archs)):
            raise LoopspecError(
                f"not a DFlash drafter: architectures={archs} (expected {ARCHITECTURE} or {DEEPSPEC_ARCHITECTURE})"
            )
        deepspec = DEEPSPEC_ARCHITECTURE in archs
        dflash = cfg.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise LoopspecError("drafter config.json: dflash_config must be an object")
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "num_target_layers",
            "num_key_value_heads",
            "head_dim",
            "block_size",
        ):
            value = cfg.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise LoopspecError(f"drafter config.json: {key} must be a positive integer, got {value!r}")
        if cfg.get("block_size", 16) < 2:
            raise LoopspecError(f"drafter config.json: block_size must be at least 2, got {cfg['block_size']}")
        ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is not None and (
            not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise LoopspecError(f"drafter config.json: target_layer_ids must be a non-empty list of ints, got {ids!r}")
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id") if deepspec else None)
        if mask is not None and (not isinstance(mask, int) or isinstance(mask, bool)):
            raise LoopspecError(f"drafter config.json: mask_token_id must be an integer, got {mask!r}")
        # DeepSpec writes the head fields at the top level; a z-lab-convention drafter with heads keeps
        # them in dflash_config (as SpecForge's DSpark export does)
        heads = cfg if deepspec else dflash
        misplaced = sorted(k for k in ("markov_rank", "enable_confidence_head") if not deepspec and k in cfg)
        if misplaced:
            raise LoopspecError(
                f"drafter config.json: {', '.join(misplaced)} of a {cfg.get('architectures')} drafter "
                "belong inside dflash_config (DeepSpec's top-level fields go with Qwen3DSparkModel)"
            )
        rank = heads.get("markov_rank", 0)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise LoopspecError(f"drafter config.json: markov_rank must be an integer >= 0, got {rank!r}")
        head_type = heads.get("markov_head_type", "vanilla") if rank else "vanilla"
        if head_type not in MARKOV_HEAD_TYPES:
            raise LoopspecError(
                f"drafter config.json: unknown markov_head_type {head_type!r} "
                f"(loopspec runs {', '.join(MARKOV_HEAD_TYPES)})"
            )
        confidence = bool(heads.get("enable_confidence_head", False))
        # DeepSpec writes confidence_head_with_markov only with a confidence head, and defaults it on
        with_markov = bool(heads.get("confidence_head_with_markov", bool(rank))) if confidence else False
        try:
            heads = cfg["num_attention_heads"]
            num_layers = cfg["num_hidden_layers"]
            num_target_layers = cfg["num_target_layers"]
            if ids is None:
                ids = default_target_layer_ids(num_target_layers, num_layers)
            rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
            rope_theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
            if rope is not None:
                rope = {k: v for k, v in rope.items() if k != "rope_theta"}
                if rope.get("rope_type", rope.get("type", "default")) == "default":
                    rope = None
            return cls(
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                vocab_size=cfg["vocab_size"],
                num_target_layers=num_target_layers,
                target_layer_ids=list(ids),
                mask_token_id=mask,
                block_size=cfg.get("block_size", 16),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=rope,
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                anchor_predicts=deepspec,
                markov_rank=rank,
                markov_head_type=head_type,
                confidence_head=confidence,
                confidence_with_markov=with_markov,
                extra=dict(cfg.get("loopspec") or {}),
            )
        except KeyError as e:
            raise LoopspecError(f"drafter config.json lacks {e.args[0]!r}") from None


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V of `x` [B, T, H] → [B, kvh, T, hd] each."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2))
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        # x: [B, k, H] block hidden; ctx_k/ctx_v: [B, kvh, C, hd] context K/V (already normed + roped)
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2))
        q = apply_rope(q, cos, sin)  # [B, h, k, hd]
        k, v = self.keys_values(x, cos, sin)
        keys = torch.cat([ctx_k, k], dim=2)  # [B, kvh, C + k, hd]
        values = torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    layer_class = DrafterLayer  # a DFlash2 drafter's layers add convolutions (model/dflash2.py)
    config_class = DrafterConfig  # what its config.json reads into (model/drafters.py)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None
        # optional reduced draft vocabulary: target ids of the draft rows (d2t map), None = full vocab
        self.draft_ids: torch.Tensor | None = None
        with torch.no_grad():  # HF's Qwen3 initialisation: N(0, 0.02) projections, unit norms
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.02)

    def new_context(self, max_length: int, rows: int = 1) -> KVCache:
        """Every layer's context K/V for `rows` sequences (one length each)."""
        p = self.fc.weight
        return KVCache(
            self.cfg.num_layers,
            rows,
            self.cfg.num_kv_heads,
            min(max_length, self.cfg.max_position_embeddings),
            self.cfg.head_dim,
            dtype=p.dtype,
            device=p.device,
        )

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """Context features hidden_norm(fc(concat(taps))): [B, T, n*H] → [B, T, H]."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's context K/V from H-dim features [B, T, H] at positions [T] (or per row [B, T])
        in ONE matmul → [N, B, kvh, T, hd]."""
        B, T, _ = features.shape
        N, kvh, hd = self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim
        weight = torch.cat([torch.cat([l.self_attn.k_proj.weight, l.self_attn.v_proj.weight]) for l in self.layers])
        kv = (features @ weight.T).view(B, T, N, 2, kvh, hd)  # [B, T, N, 2, kvh, hd]
        k = kv[:, :, :, 0].permute(2, 0, 3, 1, 4)  # [N, B, kvh, T, hd]
        v = kv[:, :, :, 1].permute(2, 0, 3, 1, 4)
        k_norm_w = torch.stack([l.self_attn.k_norm.weight for l in self.layers])  # [N, hd]
        k = k.float()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        k = k_norm_w[:, None, None, None, :] * k.to(features.dtype)
        cos, sin = self.rotary(positions)  # [T, hd], or [B, T, hd] for per-row positions [B, T]
        if positions.dim() == 2:
            cos, sin = cos[None, :, None], sin[None, :, None]  # [1, B, 1, T, hd]
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One stage: block embeddings [B, k, H] at `positions` [k] (or [B, 1, k]) attending to the
        context K/V [N, B, kvh, C, hd] and the whole block → final-norm hidden states [B, k, H]."""
        cos, sin = self.rotary(positions)
        if cos.dim() == 2:
            cos, sin = cos[None, None], sin[None, None]
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], mask)
        return self.norm(x)

    def stage_drafts(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        head,
        draft_ids: torch.Tensor | None,
        sampling: list | None = None,
    ) -> StageDrafts:
        """One stage's drafts from its block's final-norm states hidden [R, k, H] (anchors [R]; `head`
        the target's lm_head or its draft rows over `draft_ids`): the draft-head step's ranked
        candidates, or with `sampling` (each row's SamplingParams and generator) drafts sampled from q."""
        if sampling is not None:
            sampler = DraftSampler(sampling, self.cfg.vocab_size, draft_ids)
            drafts, logq, confidence, q = sample_stage(self, hidden, anchors, head, draft_ids, sampler)
            return StageDrafts(drafts, logq, hidden, None if confidence is None else confidence.cpu(), q)
        drafts, logprobs, confidence = draft_stage(self, hidden, anchors, head, draft_ids)  # [R, D, C] each, [R, D]
        return StageDrafts(
            drafts.cpu(), logprobs.float().cpu(), hidden, None if confidence is None else confidence.cpu()
        )

    def grow(self, num_layers: int) -> "Drafter":
        """This drafter deepened to `num_layers`: the existing layers kept, new ones appended with their
        o_proj and down_proj zeroed, so the new residual branches add nothing at first and the grown
        drafter drafts exactly as this one did until training moves them."""
        if num_layers < self.cfg.num_layers:
            raise LoopspecError(f"cannot grow a {self.cfg.num_layers}-layer drafter to {num_layers} layers")
        from dataclasses import replace

        p = self.fc.weight
        grown = Drafter(replace(self.cfg, num_layers=num_layers, extra=dict(self.cfg.extra))).to(p.dtype)
        missing, unexpected = grown.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
        with torch.no_grad():
            for layer in grown.layers[self.cfg.num_layers :]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        grown.draft_ids = self.draft_ids
        return grown.to(p.device).train(self.training)

    def with_heads(self, heads: DSparkHeads) -> "Drafter":
        """This drafter with DSpark heads: existing heads kept where they match, new ones added with
        markov_w2 zeroed, so the drafter drafts exactly as this one did until training moves them."""
        from dataclasses import replace

        cfg = replace(
            self.cfg,
            markov_rank=heads.markov_rank,
            markov_head_type=heads.markov_head_type if heads.markov_rank else "vanilla",
            confidence_head=heads.confidence_head,
            confidence_with_markov=heads.confidence_head and heads.markov_rank > 0,
            extra=dict(self.cfg.extra),
        )
        p = self.fc.weight
        out = Drafter(cfg).to(p.dtype)
        own = out.state_dict()
        kept = {k: v for k, v in self.state_dict().items() if k in own and own[k].shape == v.shape}
        out.load_state_dict(kept, strict=False)
        if out.markov_head is not None and cfg.markov_rank != self.cfg.markov_rank:
            with torch.no_grad():
                out.markov_head.markov_w2.weight.zero_()
        out.draft_ids = self.draft_ids
        return out.to(p.device).train(self.training)

    # ----------------------------------------------------------------------------------------------
    # z-lab checkpoint I/O

    def zlab_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.state_dict().items():
            if ".mlp.gate_up_proj." in name:
                gate, up = t.split(self.cfg.intermediate_size, dim=0)
                out[name.replace("gate_up_proj", "gate_proj")] = gate
                out[name.replace("gate_up_proj", "up_proj")] = up
            else:
                out[name] = t
        return out

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg.to_zlab()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        state = {k: v.detach().to(dtype).cpu() for k, v in self.zlab_state_dict().items()}
        write_safetensors(state, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        self.save_d2t(directory)

    def save_d2t(self, directory: str | Path) -> None:
        """The reduced draft vocabulary as `d2t.safetensors` (what `load` reads; none without one)."""
        path = Path(directory) / D2T_FILE
        if self.draft_ids is None:
            path.unlink(missing_ok=True)  # a stale map of an earlier save must not be read back
            return
        # EAGLE-3 / vLLM convention: target id = draft id + d2t[draft id]
        write_safetensors({"d2t": (self.draft_ids - torch.arange(self.draft_ids.numel())).to(torch.int64)}, path)

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32, raw: dict | None = None) -> "Drafter":
        """The drafter in `directory` (`raw`: its config.json, when the caller has read it)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise LoopspecError(f"drafter path does not exist or is not a directory: {directory}")
        if raw is None:
            raw = read_json(directory / "config.json", "drafter config")
        refuse_quantized(raw, directory)
        cfg = cls.config_class.from_checkpoint(raw)
        state = drafter_tensors(directory, cfg.num_layers)
        # the config's sizes are checked against the file's tensors on the meta device (no memory)
        # before any is allocated: a size no file could hold (a rank of 2^40) is refused, not attempted
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in cls(cfg).state_dict().items()}
        for name, shape in shapes.items():
            if name in state and tuple(state[name].shape) != shape:
                raise LoopspecError(
                    f"drafter weights do not match its config.json: size mismatch for {name}: "
                    f"{list(state[name].shape)} in the file, the config makes it {list(shape)}"
                )
        model = cls(cfg)
        for name, t in state.items():
            if not torch.is_floating_point(t):
                raise LoopspecError(f"drafter tensor {name} has non-float dtype {t.dtype}")
        try:
            model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        except RuntimeError as e:
            raise LoopspecError(f"drafter weights do not match its config.json: {one_line(e)}") from None
        d2t_path = directory / D2T_FILE
        if d2t_path.is_file():
            d2t = read_safetensors(d2t_path).get("d2t")
            if d2t is None or d2t.dim() != 1:
                raise LoopspecError(f"{d2t_path} must hold a 1-D 'd2t' tensor")
            ids = torch.arange(d2t.numel()) + d2t.long()  # EAGLE-3 / vLLM convention: target = draft + d2t
            if ids.min() < 0 or ids.max() >= cfg.vocab_size or ids.unique().numel() != ids.numel():
                raise LoopspecError(f"{d2t_path} maps draft rows outside the vocabulary or twice")
            model.draft_ids = ids
        return model.to(dtype).eval()


def drafter_tensors(directory: Path, num_layers: int) -> dict[str, torch.Tensor]:
    """A block drafter's checkpoint tensors under the module's names: model.safetensors (or its
    shards), without a copy of the target's embedding or lm_head, each layer's gate and up fused."""
    weights = directory / "model.safetensors"
    # Hugging Face shards a large save_pretrained as model-0000i-of-0000n.safetensors
    files = [weights] if weights.is_file() else sorted(directory.glob("model-*-of-*.safetensors"))
    if not files:
        raise LoopspecError(f"missing drafter weights: {weights}")
    src = {}
    for f in files:
        src.update(read_safetensors(f))
    for unexpected in ("embed_tokens.weight", "lm_head.weight"):
        src.pop(unexpected, None)  # some exports (DeepSpec's) carry a copy of the target's; we borrow the target's
    state = {}
    for i in range(num_layers):
        m = f"layers.{i}.mlp."
        if m + "gate_proj.weight" in src and m + "up_proj.weight" in src:
            state[m + "gate_up_proj.weight"] = torch.cat(
                [src.pop(m + "gate_proj.weight"), src.pop(m + "up_proj.weight")]
            )
    state.update(src)
    return state
