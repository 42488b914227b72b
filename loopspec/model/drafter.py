"""DFlash block-diffusion drafter: z-lab's checkpoint format, and DeepSpec's DSpark / DFlash format.

One forward ("stage") drafts a whole block `[anchor, MASK × (k-1)]` at positions a .. a+k-1. Every
layer's queries come from the block only; its keys/values are `[context ; block]`, where the context
is the target's tapped hidden states projected by `fc` → `hidden_norm` and then by the layer's own
`k_proj`/`v_proj` (+ `k_norm`, RoPE at absolute positions). Inside the block attention is
bidirectional. The drafter has no embedding or lm_head of its own: it borrows the target's.

Which block outputs are drafts is the drafter's block convention (`DrafterConfig.anchor_predicts`):
z-lab's output at block position i (1..k-1) predicts the token AT position a+i (k-1 drafts);
DeepSpec's output at every position i (0..k-1) predicts the token at a+i+1 (k drafts).

A DSpark drafter adds two small heads on the final-norm states h_i (`draft_stage` runs them):
- a low-rank Markov head that corrects each position's logits by the token before it,
  z_i = lm_head(h_i) + W2·u_i, left to right, where prev_0 is the anchor and prev_{i+1} the argmax of
  z_i; u_i = W1[prev_i] (vanilla), σ(gate([h_i ; W1[prev_i]])) ⊙ W1[prev_i] (gated), or a GRU-like
  state s_i over joint([s_{i-1} ; W1[prev_i] ; h_i]) → (g, c, o) with u_i = tanh(o) (rnn);
- a confidence head σ(proj([h_i ; W1[prev_i]])) (or of h_i alone): the estimated probability that
  draft i is accepted given that the drafts before it were.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.errors import LoopspecError
from loopspec.files import one_line, read_json, read_safetensors, refuse_quantized, write_safetensors
from loopspec.model.target import (MLP, KVCache, RMSNorm, RotaryTable, TargetConfig, apply_rope,
                                   default_target_layer_ids)

ARCHITECTURE = "DFlashDraftModel"
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's DSpark drafters, and its DFlash ones (markov_rank 0)
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
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
            raise LoopspecError(f"unknown markov_head_type {self.markov_head_type!r} "
                                f"(choose from {', '.join(MARKOV_HEAD_TYPES)})")
        if self.markov_rank < 0:
            raise LoopspecError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.confidence_with_markov and not (self.confidence_head and self.markov_rank):
            raise LoopspecError("confidence_head_with_markov needs both a confidence head and a Markov head "
                                "(markov_rank > 0)")

    @property
    def first_draft(self) -> int:
        """The first block position whose output is a draft (0: the anchor's own, DeepSpec's convention)."""
        return 0 if self.anchor_predicts else 1

    def drafts_per_block(self, block_size: int) -> int:
        """How many drafts one stage of `block_size` positions yields."""
        return block_size - self.first_draft

    @property
    def is_dspark(self) -> bool:
        """Carries a head that runs after the lm_head (the Markov or confidence head)."""
        return bool(self.markov_rank or self.confidence_head)

    @classmethod
    def for_target(cls, target: TargetConfig, num_layers: int = 1, block_size: int = 16,
                   target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                   intermediate_size: int | None = None) -> "DrafterConfig":
        """A fresh drafter whose widths are all set explicitly from the target's."""
        if num_layers < 1:
            raise LoopspecError(f"a drafter needs at least one layer, got {num_layers}")
        if block_size < 2:
            raise LoopspecError(f"block size must be at least 2, got {block_size}")
        ids = target_layer_ids if target_layer_ids is not None else default_target_layer_ids(target.num_layers, num_layers)
        if not ids:
            raise LoopspecError("target_layer_ids must name at least one target layer")
        return cls(hidden_size=target.hidden_size,
                   intermediate_size=intermediate_size or target.intermediate_size,
                   num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, vocab_size=target.vocab_size,
                   num_target_layers=target.num_layers, target_layer_ids=list(ids),
                   mask_token_id=mask_token_id, block_size=block_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                   max_position_embeddings=target.max_position_embeddings)

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
            cfg.update({"architectures": [DEEPSPEC_ARCHITECTURE], "mask_token_id": self.mask_token_id,
                        "target_layer_ids": self.target_layer_ids, **heads})
        elif self.is_dspark:  # z-lab's convention with heads: the head fields beside the mask and taps
            cfg["dflash_config"].update(heads)
        if self.extra:
            cfg["loopspec"] = self.extra
        return cfg

    @classmethod
    def from_zlab(cls, cfg: dict) -> "DrafterConfig":
        """Read a drafter's config.json: z-lab's `DFlashDraftModel` (mask and taps in `dflash_config`),
        or DeepSpec's `Qwen3DSparkModel` (DSpark, or DFlash with markov_rank 0: the fields at the top
        level, DeepSpec's block convention)."""
        if not isinstance(cfg, dict):
            raise LoopspecError(f"drafter config.json must hold a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not ({ARCHITECTURE, DEEPSPEC_ARCHITECTURE} & set(archs)):
            raise LoopspecError(f"not a DFlash drafter: architectures={archs} "
                                f"(expected {ARCHITECTURE} or {DEEPSPEC_ARCHITECTURE})")
        deepspec = DEEPSPEC_ARCHITECTURE in archs
        dflash = cfg.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise LoopspecError("drafter config.json: dflash_config must be an object")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "vocab_size", "num_target_layers", "num_key_value_heads", "head_dim", "block_size"):
            value = cfg.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise LoopspecError(f"drafter config.json: {key} must be a positive integer, got {value!r}")
        if cfg.get("block_size", 16) < 2:
            raise LoopspecError(f"drafter config.json: block_size must be at least 2, got {cfg['block_size']}")
        ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is not None and (not isinstance(ids, list) or not ids
                                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise LoopspecError(f"drafter config.json: target_layer_ids must be a non-empty list of ints, got {ids!r}")
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id") if deepspec else None)
        if mask is not None and (not isinstance(mask, int) or isinstance(mask, bool)):
            raise LoopspecError(f"drafter config.json: mask_token_id must be an integer, got {mask!r}")
        # DeepSpec writes the head fields at the top level; a z-lab-convention drafter with heads keeps
        # them in dflash_config (as SpecForge's DSpark export does)
        heads = cfg if deepspec else dflash
        misplaced = sorted(k for k in ("markov_rank", "enable_confidence_head") if not deepspec and k in cfg)
        if misplaced:
            raise LoopspecError(f"drafter config.json: {', '.join(misplaced)} of a {cfg.get('architectures')} drafter "
                                "belong inside dflash_config (DeepSpec's top-level fields go with Qwen3DSparkModel)")
        rank = heads.get("markov_rank", 0)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise LoopspecError(f"drafter config.json: markov_rank must be an integer >= 0, got {rank!r}")
        head_type = heads.get("markov_head_type", "vanilla") if rank else "vanilla"
        if head_type not in MARKOV_HEAD_TYPES:
            raise LoopspecError(f"drafter config.json: unknown markov_head_type {head_type!r} "
                                f"(loopspec runs {', '.join(MARKOV_HEAD_TYPES)})")
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
            return cls(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_layers=num_layers, num_heads=heads,
                       num_kv_heads=cfg.get("num_key_value_heads") or heads,
                       head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                       vocab_size=cfg["vocab_size"], num_target_layers=num_target_layers,
                       target_layer_ids=list(ids), mask_token_id=mask,
                       block_size=cfg.get("block_size", 16), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                       rope_theta=float(rope_theta), rope_scaling=rope,
                       max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                       anchor_predicts=deepspec, markov_rank=rank, markov_head_type=head_type,
                       confidence_head=confidence, confidence_with_markov=with_markov,
                       extra=dict(cfg.get("loopspec") or {}))
        except KeyError as e:
            raise LoopspecError(f"drafter config.json lacks {e.args[0]!r}") from None


def check_fits(drafter: DrafterConfig, target: TargetConfig) -> None:
    """Refuse a drafter that cannot run against this target, naming what does not match."""
    problems = []
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden size {drafter.hidden_size} != target's {target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocab size {drafter.vocab_size} != target's {target.vocab_size}")
    if drafter.num_target_layers != target.num_layers:
        problems.append(f"drafter was built for {drafter.num_target_layers} target layers, target has {target.num_layers}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"tap ids {bad} out of range for a target with {target.num_layers} layers")
    if drafter.mask_token_id is None:
        problems.append("no mask token id (set dflash_config.mask_token_id, or mask_token_id in a DeepSpec config)")
    elif not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(f"mask token id {drafter.mask_token_id} outside the vocabulary of {target.vocab_size}")
    if problems:
        raise LoopspecError("drafter does not fit the target: " + "; ".join(problems))


def drafter_kind(cfg: DrafterConfig) -> str:
    """What a drafter is, in a few words: its heads and its block convention."""
    if not cfg.is_dspark:
        return "DeepSpec DFlash" if cfg.anchor_predicts else "z-lab DFlash"
    heads = [f"{cfg.markov_head_type} Markov head of rank {cfg.markov_rank}"] if cfg.markov_rank else []
    heads += ["confidence head"] if cfg.confidence_head else []
    convention = "DeepSpec's block convention" if cfg.anchor_predicts else "z-lab's block convention"
    return f"DSpark ({', '.join(heads)}; {convention})"


def require_zlab_block(cfg: DrafterConfig, what: str) -> None:
    """Refuse a drafter of DeepSpec's block convention or with DSpark heads where only the z-lab
    block (k-1 drafts from block positions 1.., no head after the lm_head) is implemented (quantized
    drafter graphs, the llama.cpp GGUF, serving bundles). The torch engine, the fp32 ONNX / TensorRT
    drafter graphs and training run both conventions and the DSpark heads."""
    if cfg.anchor_predicts or cfg.is_dspark:
        raise LoopspecError(f"{what} supports z-lab DFlash drafters only, not this {drafter_kind(cfg)} drafter; "
                            "decode it with --backend torch or onnxruntime")


def resolve_mask_token_id(configured: int | None, tokenizer_len: int | None, vocab_size: int) -> int:
    """The checkpoint's mask id; else the first unused embedding row; else a clear error."""
    if configured is not None:
        return configured
    if tokenizer_len is not None and tokenizer_len < vocab_size:
        return tokenizer_len
    raise LoopspecError("the drafter has no mask_token_id and the target's vocabulary has no unused row; "
                        "pass --mask-token-id")


def draft_head_weight(lm_head_weight: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The rows of the target's lm_head a drafter drafts over: all of them, or its reduced draft
    vocabulary's (target ids `draft_ids`, the d2t map) → [V or Vd, H]."""
    return lm_head_weight if draft_ids is None else lm_head_weight[draft_ids]


DRAFT_CANDIDATES = 8  # ranked candidates the draft head returns per block position (draft trees branch over them)


def draft_candidates(logits: torch.Tensor, draft_ids: torch.Tensor | None,
                     top_k: int = DRAFT_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft-head step: logits [..., V or Vd] over the draft head's rows → each position's `top_k`
    best drafts, rank-ordered, as target ids, and their log-probabilities, both [..., top_k]; rank 0
    is the argmax (the chain). Written in plain ops so that the exported drafter graph runs exactly
    this too."""
    best, index = logits.topk(min(top_k, logits.shape[-1]), dim=-1)  # [..., K] descending
    top = best[..., :1]
    logprobs = best - top - torch.log(torch.exp(logits - top).sum(-1, keepdim=True))  # log softmax at each
    return (draft_ids[index] if draft_ids is not None else index), logprobs


@dataclass(frozen=True)
class DSparkHeads:
    """The DSpark heads a drafter is given for training: a Markov head of `markov_rank` (0: none) and
    `markov_head_type`, and a confidence head (reading W1[prev] too when there is a Markov head)."""

    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False

    def __post_init__(self):
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise LoopspecError(f"unknown Markov head type {self.markov_head_type!r} "
                                f"(choose from {', '.join(MARKOV_HEAD_TYPES)})")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise LoopspecError(f"Markov rank must be an integer >= 0, got {self.markov_rank!r}")
        if not (self.markov_rank or self.confidence_head):
            raise LoopspecError("a DSpark drafter needs a Markov head (rank > 0) or a confidence head")


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov correction: a bias W2·u over the vocabulary from the token before a
    position (`markov_w1`, an embedding [V, r]), gated by the position's state or carried through a
    recurrent state (see the module docstring). Parameter names are DeepSpec's."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        r, H = cfg.markov_rank, cfg.hidden_size
        self.kind = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)  # rows: gate | candidate | output

    def latent(self, prev: torch.Tensor, h: torch.Tensor,
               state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: previous tokens prev [R] (target ids) and final-norm states h [R, H] → the
        rank-r latent u [R, r] whose W2 product is the bias, and the recurrent state after it (rnn)."""
        e = self.markov_w1(prev).to(h.dtype)  # [R, r]
        if self.kind == "vanilla":
            return e, state
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e, state
        if state is None:  # the state starts at zero at every block's first drafting position
            state = torch.zeros_like(e)
        gate, candidate, output = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)  # [R, r] each
        gate = torch.sigmoid(gate)
        return torch.tanh(output), gate * state + (1 - gate) * torch.tanh(candidate)


class ConfidenceHead(nn.Module):
    """DSpark's per-position acceptance estimate σ(proj(features)), features [h ; W1[prev]] or h."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0), 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features).squeeze(-1).float())


class StageDrafts(tuple):
    """What an engine's `draft` returns: the tuple (drafts [R, D, C], log-probs [R, D, C], hidden
    [R, k, H]) of the Engine protocol, which callers unpack as three, and the confidence head's
    per-position estimates [R, D] as `.confidence` (None without a confidence head); with drafts
    sampled from the drafter (`sample_stage`), the distribution q [R, D, V] each was drawn from as
    `.q` (None otherwise)."""

    confidence: torch.Tensor | None
    q: torch.Tensor | None

    def __new__(cls, drafts: torch.Tensor, logprobs: torch.Tensor, hidden: torch.Tensor,
                confidence: torch.Tensor | None = None, q: torch.Tensor | None = None):
        out = super().__new__(cls, (drafts, logprobs, hidden))
        out.confidence, out.q = confidence, q
        return out


def draft_stage(drafter: "Drafter", hidden: torch.Tensor, anchors: torch.Tensor, head,
                draft_ids: torch.Tensor | None, top_k: int = DRAFT_CANDIDATES
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The draft-head step of one stage: the final-norm states of blocks hidden [R, k, H] whose
    anchors are `anchors` [R] → each drafting position's `top_k` candidates [R, D, C] (target ids,
    rank 0 the argmax chain), their log-probabilities [R, D, C], and the confidence head's estimates
    [R, D] (None without one). D is k-1 or k, by the drafter's block convention. `head` maps states
    [..., H] to logits over the draft rows [..., V or Vd] (the target's lm_head, or its draft rows).

    A DSpark head runs left to right: position i's logits are corrected by the token before it —
    the anchor at the first drafting position, then the previous position's corrected argmax — so
    the chain is the greedy Markov chain and a tree's other ranks come from the same corrected
    logits. Written in plain ops, as `draft_candidates`."""
    cfg = drafter.cfg
    h = hidden[:, cfg.first_draft:]  # [R, D, H]
    logits = head(h)  # [R, D, V or Vd]
    if not cfg.is_dspark:
        drafts, logprobs = draft_candidates(logits, draft_ids, top_k)
        return drafts, logprobs, None
    corrected, prevs = corrected_logits(drafter, h, logits, anchors, draft_ids, lambda z: z.argmax(-1))
    drafts, logprobs = draft_candidates(corrected, draft_ids, top_k)  # [R, D, C] each
    return drafts, logprobs, stage_confidence(drafter, h, prevs)


def sample_stage(drafter: "Drafter", hidden: torch.Tensor, anchors: torch.Tensor, head,
                 draft_ids: torch.Tensor | None, sampler
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The draft-head step of one stage with drafts sampled from the drafter's distribution q
    (`sampler`: a loopspec.decoding.DraftSampler over the stage's rows) instead of its argmax →
    the drafts [R, D, 1] (target ids), their log q [R, D, 1], the confidence head's estimates [R, D]
    (or None) and q [R, D, V] over the target's vocabulary (on the CPU). A DSpark drafter's q at
    position i is its Markov-corrected distribution given the token sampled at i - 1."""
    h = hidden[:, drafter.cfg.first_draft:]  # [R, D, H]
    _, prevs = corrected_logits(drafter, h, head(h), anchors, draft_ids, sampler.choose)
    drafts, logq, q = sampler.drafts()
    return drafts, logq, stage_confidence(drafter, h, prevs), q


def corrected_logits(drafter: "Drafter", h: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                     draft_ids: torch.Tensor | None, choose) -> tuple[torch.Tensor, torch.Tensor]:
    """Left to right over the drafting positions' states h [R, D, H] and logits [R, D, V or Vd]:
    each position's logits plus the Markov head's bias from the token before it (none without a
    Markov head), and the token `choose(corrected logits [R, V or Vd])` picks there (a draft-row
    index [R]) as the next position's predecessor → corrected logits [R, D, V or Vd] and each
    position's predecessor [R, D] (target ids; the anchor first)."""
    markov = drafter.markov_head
    w2 = None
    if markov is not None and draft_ids is not None:  # the bias over the draft rows only
        w2 = draft_head_weight(markov.markov_w2.weight, draft_ids)  # [Vd, r]
    prev, state = anchors, None  # [R]
    prevs, corrected = [], []
    for i in range(h.shape[1]):
        prevs.append(prev)
        z = logits[:, i]  # [R, V or Vd]
        if markov is not None:
            u, state = markov.latent(prev, h[:, i], state)  # [R, r]
            z = z + (markov.markov_w2(u) if w2 is None else F.linear(u, w2)).to(z.dtype)
        corrected.append(z)
        chosen = choose(z).to(z.device)  # [R]: the draft here is the next position's predecessor
        prev = draft_ids[chosen] if draft_ids is not None else chosen
    return torch.stack(corrected, dim=1), torch.stack(prevs, dim=1)


def stage_confidence(drafter: "Drafter", h: torch.Tensor, prevs: torch.Tensor) -> torch.Tensor | None:
    """The confidence head's estimates [R, D] at states h [R, D, H] with predecessors prevs [R, D]
    (None without a confidence head)."""
    if drafter.confidence_head is None:
        return None
    features = h
    if drafter.cfg.confidence_with_markov:
        features = torch.cat([h, drafter.markov_head.markov_w1(prevs).to(h.dtype)], dim=-1)  # [R, D, H + r]
    return drafter.confidence_head(features)  # [R, D]


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
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
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
        return KVCache(self.cfg.num_layers, rows, self.cfg.num_kv_heads,
                            min(max_length, self.cfg.max_position_embeddings), self.cfg.head_dim,
                            dtype=p.dtype, device=p.device)

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

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One stage: block embeddings [B, k, H] at `positions` [k] (or [B, 1, k]) attending to the
        context K/V [N, B, kvh, C, hd] and the whole block → final-norm hidden states [B, k, H]."""
        cos, sin = self.rotary(positions)
        if cos.dim() == 2:
            cos, sin = cos[None, None], sin[None, None]
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], mask)
        return self.norm(x)

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
            for layer in grown.layers[self.cfg.num_layers:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        grown.draft_ids = self.draft_ids
        return grown.to(p.device).train(self.training)

    def with_heads(self, heads: DSparkHeads) -> "Drafter":
        """This drafter with DSpark heads: existing heads kept where they match, new ones added with
        markov_w2 zeroed, so the drafter drafts exactly as this one did until training moves them."""
        from dataclasses import replace

        cfg = replace(self.cfg, markov_rank=heads.markov_rank,
                      markov_head_type=heads.markov_head_type if heads.markov_rank else "vanilla",
                      confidence_head=heads.confidence_head,
                      confidence_with_markov=heads.confidence_head and heads.markov_rank > 0,
                      extra=dict(self.cfg.extra))
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
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "Drafter":
        directory = Path(directory)
        if not directory.is_dir():
            raise LoopspecError(f"drafter path does not exist or is not a directory: {directory}")
        raw = read_json(directory / "config.json", "drafter config")
        refuse_quantized(raw, directory)
        cfg = DrafterConfig.from_zlab(raw)
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
        for i in range(cfg.num_layers):
            m = f"layers.{i}.mlp."
            if m + "gate_proj.weight" in src and m + "up_proj.weight" in src:
                state[m + "gate_up_proj.weight"] = torch.cat([src.pop(m + "gate_proj.weight"), src.pop(m + "up_proj.weight")])
        state.update(src)
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
