"""EAGLE-3 drafters in SpecForge's checkpoint layout (`LlamaForCausalLMEagle3`), as vLLM and SGLang load them.

The format:
- config.json: a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`,
  `vocab_size` (the target's) and `draft_vocab_size` (the drafter's own lm_head rows). The target
  layers it reads may be pinned at the top level as `eagle_aux_hidden_state_layer_ids`, as vLLM
  reads them (id j: the stream entering target layer j, the output of layer j-1), or inside
  `eagle_config`, as SGLang and SpecForge read them (id i: the output of layer i); else they are
  vLLM's / SGLang's default, the streams entering layers (2, L/2, L-3) of a target of L layers.
  The states are concatenated in layer order. loopspec's tap i is the output of layer i.
- model.safetensors: `fc.weight` [H, 3·H_target] fuses the three taps; one decoder layer under
  `midlayer.` whose q/k/v projections read 2H: [input_layernorm(embedding) ; hidden_norm(fused)];
  `norm.weight`; `lm_head.weight` [draft_vocab, H]; `d2t` (int64 [draft_vocab]: target id = draft
  id + d2t[draft id]) and `t2d` (bool [vocab]: the target ids the draft rows cover). `embed_tokens`
  is usually absent: the target's embedding is shared.

One step over entries (token t, state s) at positions p: x = [input_layernorm(embed(t)) ;
hidden_norm(s)], r = s (hidden_norm(s) with `norm_before_residual`), h = r + o_proj(attn(x)),
out = h + mlp(post_attention_layernorm(h)); the logits are lm_head(norm(out)) and `out` (before the
final norm) is the next step's state.
Config switches (`Eagle3Variant`, read where vLLM and SGLang read them): `fc_norm` norms each tap and
`norm_before_fc` the three concatenated before fc; `norm_output` makes the next step's state the
final-normed output (EAGLE 3.1 = fc_norm + norm_output); `norm_before_residual` as above.
Its context pairs the target's fused taps at position p with the token at p+1, so the first step of a
round is the entry (anchor at a, fused taps at a-1) at position a-1, and step i >= 2 is (draft i-1, the
state step i-1 returned) at position a+i-2. Every step attends to the row's cached entries and the steps
before it (one KV cache, one layer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.errors import LoopspecError
from loopspec.files import read_json, read_safetensors, refuse_quantized, write_safetensors
from loopspec.model.drafter_kinds import DRAFTER_KINDS, EAGLE3_ARCHITECTURE, DrafterKind, Eagle3Variant
from loopspec.model.target import MLP, RMSNorm, TargetConfig, apply_rope, rope_inv_freq

NUM_TAPS = 3  # low, middle and high target layers, fused by fc
OLD_TAP_NORM_NAMES = {
    f"aux_norm_{level}.weight": f"fc_norm.{i}.weight" for i, level in enumerate(("low", "mid", "high"))
}
DEFAULT_BLOCK_SIZE = 8  # a stage drafts block_size - 1 tokens


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers of a target of L layers: (2, L // 2, L - 3), in its numbering."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def _positive_int(cfg: dict, key: str, default=None) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LoopspecError(f"EAGLE-3 config.json: {key} must be a positive integer, got {value!r}")
    return value


def _aux_ids(ids, key: str, least: int) -> list[int] | None:
    """Three distinct tap ids >= `least`, sorted (the states are gathered in layer order), or None."""
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise LoopspecError(f"EAGLE-3 config.json: {key} must be a list of ints, got {ids!r}")
    if len(ids) != NUM_TAPS:
        raise LoopspecError(
            f"EAGLE-3 config.json: {key} names {len(ids)} layers {ids}; EAGLE-3 fuses exactly "
            f"{NUM_TAPS} (low, middle, high)"
        )
    if min(ids) < least or len(set(ids)) != NUM_TAPS:
        raise LoopspecError(f"EAGLE-3 config.json: {key} {ids} must be distinct and >= {least}")
    return sorted(ids)


def _variant(cfg: dict, eagle: dict) -> Eagle3Variant:
    """The switches of an EAGLE-3 config.json, where its readers look for them: norm_before_fc in
    eagle_config first, then at the top level (vLLM and SGLang); the others at the top level only
    (fc_norm also under SGLang's older name use_aux_norm). A switch left inside eagle_config, where no
    reader looks, is refused rather than ignored."""
    for key in ("fc_norm", "norm_output", "norm_before_residual", "use_aux_norm"):
        if key in eagle and bool(eagle[key]) != bool(cfg.get(key, False)):
            raise LoopspecError(
                f"EAGLE-3 config.json: eagle_config.{key} is {eagle[key]!r} and the top level's "
                f"{cfg.get(key, False)!r}; vLLM and SGLang read {key} at the top level only"
            )
    switches = {
        "fc_norm": cfg.get("fc_norm") or cfg.get("use_aux_norm", False),
        "norm_before_fc": eagle.get("norm_before_fc", cfg.get("norm_before_fc", False)),
        "norm_output": cfg.get("norm_output", False),
        "norm_before_residual": cfg.get("norm_before_residual", False),
    }
    for key, value in switches.items():
        if value is not None and not isinstance(value, bool):
            raise LoopspecError(f"EAGLE-3 config.json: {key} must be true or false, got {value!r}")
    return Eagle3Variant(**{key: bool(value) for key, value in switches.items()})


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (t2d covers it)
    draft_vocab_size: int  # the lm_head's rows (d2t maps them to target ids)
    # loopspec taps (the output of target layer i); None: vLLM's default, fixed by `fit`
    target_layer_ids: list[int] | None
    num_target_layers: int | None = None
    target_hidden_size: int | None = None  # the taps' width (None: hidden_size)
    block_size: int = DEFAULT_BLOCK_SIZE
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    variant: Eagle3Variant = field(default_factory=Eagle3Variant)  # the config switches it turns on
    extra: dict = field(default_factory=dict)  # loopspec settings kept beside the format's fields
    mask_token_id: ClassVar[None] = None  # a chain drafter fills no block with a mask token
    num_layers: ClassVar[int] = 1

    @property
    def kind(self) -> DrafterKind:
        return replace(DRAFTER_KINDS["eagle3"], eagle3=self.variant)

    def fit(self, target: TargetConfig) -> None:
        """Refuse a drafter that cannot run against `target`, naming what does not match; taps not
        pinned get vLLM's default ones for this target."""
        problems = []
        L = target.num_layers
        if self.num_target_layers is not None and self.num_target_layers != L:
            problems.append(f"drafter was built for {self.num_target_layers} target layers, target has {L}")
        if self.target_layer_ids is None:
            ids = default_aux_layer_ids(L)
            if len(set(ids)) != NUM_TAPS or min(ids) < 1:
                problems.append(
                    f"a target of {L} layers has no three distinct default EAGLE-3 taps (2, L/2, L-3 = {ids}): "
                    "pin them with eagle_aux_hidden_state_layer_ids"
                )
            else:
                self.target_layer_ids = [j - 1 for j in ids]
        if self.target_layer_ids is not None and not all(0 <= i < L - 1 for i in self.target_layer_ids):
            problems.append(f"aux hidden state layers {self.aux_layer_ids} out of range for a target of {L} layers")
        if self.tap_width != target.hidden_size:
            problems.append(
                f"fc reads taps of width {self.tap_width}, the target's hidden size is {target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab size {self.vocab_size} != target's {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            problems.append(
                f"hidden size {self.hidden_size} != target's {target.hidden_size} (the embedding is the target's)"
            )
        if problems:
            raise LoopspecError("drafter does not fit the target: " + "; ".join(problems))
        self.num_target_layers = L

    @property
    def first_draft(self) -> int:
        return self.kind.convention.first_draft

    def drafts_per_block(self, block_size: int) -> int:
        return self.kind.drafts_per_block(block_size)

    @property
    def num_taps(self) -> int:
        return NUM_TAPS

    @property
    def tap_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def aux_layer_ids(self) -> list[int] | None:
        """The taps in vLLM's numbering (the stream entering layer j = the output of layer j-1)."""
        return None if self.target_layer_ids is None else [i + 1 for i in self.target_layer_ids]

    @classmethod
    def from_checkpoint(cls, cfg: dict) -> "Eagle3Config":
        """Read an EAGLE-3 config.json (SpecForge / vLLM), refusing what loopspec does not run."""
        if not isinstance(cfg, dict):
            raise LoopspecError(f"EAGLE-3 config.json must hold a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or EAGLE3_ARCHITECTURE not in archs:
            raise LoopspecError(f"not an EAGLE-3 drafter: architectures={archs} (expected {EAGLE3_ARCHITECTURE})")
        layers = _positive_int(cfg, "num_hidden_layers")
        if layers != 1:
            raise LoopspecError(
                f"EAGLE-3 config.json: num_hidden_layers {layers}; loopspec runs the one-layer "
                "EAGLE-3 drafter (midlayer) only"
            )
        eagle = cfg.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise LoopspecError("EAGLE-3 config.json: eagle_config must be an object")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise LoopspecError(
                "EAGLE-3 config.json: use_aux_hidden_state false (an EAGLE-1/2 drafter reading the "
                "last hidden state) is not run; loopspec runs EAGLE-3's three fused taps"
            )
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise LoopspecError(f"EAGLE-3 config.json: {key} true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise LoopspecError(f"EAGLE-3 config.json: hidden_act {cfg['hidden_act']!r} (loopspec runs silu)")
        # vLLM reads the top-level ids, numbered as the stream entering layer j (the output of j-1);
        # SGLang (and SpecForge) read eagle_config's, numbered as the output of layer i
        vllm = _aux_ids(cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", 1)
        sglang = _aux_ids(
            eagle.get("eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids", 0
        )
        vllm = None if vllm is None else [j - 1 for j in vllm]
        if vllm is not None and sglang is not None and vllm != sglang:
            raise LoopspecError(
                f"EAGLE-3 config.json: eagle_aux_hidden_state_layer_ids (vLLM's numbering: layer outputs "
                f"{vllm}) and eagle_config's (SGLang's: {sglang}) name different target layers"
            )
        taps = vllm if vllm is not None else sglang
        variant = _variant(cfg, eagle)
        hidden, heads = _positive_int(cfg, "hidden_size"), _positive_int(cfg, "num_attention_heads")
        vocab = _positive_int(cfg, "vocab_size")
        draft_vocab = _positive_int(cfg, "draft_vocab_size", vocab)
        if draft_vocab > vocab:
            raise LoopspecError(f"EAGLE-3 config.json: draft_vocab_size {draft_vocab} > vocab_size {vocab}")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        if rope is not None:
            rope = {k: v for k, v in rope.items() if k != "rope_theta"}
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
        extra = dict(cfg.get("loopspec") or {})
        block_size = _positive_int(extra, "block_size", DEFAULT_BLOCK_SIZE)
        extra.pop("block_size", None)
        if block_size < 2:
            raise LoopspecError(f"EAGLE-3 config.json: loopspec.block_size must be at least 2, got {block_size}")
        return cls(
            hidden_size=hidden,
            intermediate_size=_positive_int(cfg, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=_positive_int(cfg, "num_key_value_heads", heads),
            head_dim=_positive_int(cfg, "head_dim", hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            target_layer_ids=taps,
            num_target_layers=cfg.get("num_target_layers"),
            target_hidden_size=cfg.get("target_hidden_size"),
            block_size=block_size,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            variant=variant,
            extra=extra,
        )

    def to_hf(self) -> dict:
        """SpecForge's config.json, with the taps pinned as vLLM reads them."""
        cfg = {
            "architectures": [EAGLE3_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "loopspec": {**self.extra, "block_size": self.block_size},
        }
        if self.aux_layer_ids is not None:  # in vLLM's numbering, and in SGLang's
            cfg["eagle_aux_hidden_state_layer_ids"] = self.aux_layer_ids
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids)}
        if self.num_target_layers is not None:
            cfg["num_target_layers"] = self.num_target_layers
        if self.target_hidden_size is not None:
            cfg["target_hidden_size"] = self.target_hidden_size
        for switch in self.variant.switched_on:  # at the top level, where every reader looks
            cfg[switch] = True
        return cfg


class Norm(RMSNorm):
    """RMSNorm, computed in fp64 for fp64 inputs (the shared one upcasts 16-bit inputs to fp32 only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float64:
            return super().forward(x)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Eagle3Layer(nn.Module):
    """The one decoder layer (`midlayer`): attention over 2H inputs, SwiGLU, pre-norms."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.hidden_norm = Norm(H, cfg.rms_norm_eps)
        self.input_layernorm = Norm(H, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(2 * H, q, bias=False)
        self.k_proj = nn.Linear(2 * H, kv, bias=False)
        self.v_proj = nn.Linear(2 * H, kv, bias=False)
        self.o_proj = nn.Linear(q, H, bias=False)
        self.post_attention_layernorm = Norm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)


# loopspec's module names → the checkpoint's (the layer's attention projections sit under self_attn.)
def _file_name(name: str) -> str:
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if name == f"midlayer.{proj}.weight":
            return f"midlayer.self_attn.{proj}.weight"
    return name


class Eagle3Drafter(nn.Module):
    """fc, the midlayer, norm and lm_head; `embed_tokens` only when the checkpoint carries its own
    (None: the target's is borrowed); `draft_ids` the target id of every lm_head row (None: the
    identity, a full draft vocabulary)."""

    config_class = Eagle3Config  # what its config.json reads into (model/drafters.py)

    def __init__(self, cfg: Eagle3Config, own_embedding: bool = False):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(NUM_TAPS * cfg.tap_width, cfg.hidden_size, bias=False)
        # EAGLE 3.1's norm on each tap, or one norm over the three concatenated, before fc
        self.fc_norm = (
            nn.ModuleList(Norm(cfg.tap_width, cfg.rms_norm_eps) for _ in range(NUM_TAPS))
            if cfg.variant.fc_norm
            else None
        )
        self.input_norm = Norm(NUM_TAPS * cfg.tap_width, cfg.rms_norm_eps) if cfg.variant.norm_before_fc else None
        self.midlayer = Eagle3Layer(cfg)
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.draft_ids: torch.Tensor | None = None
        inv_freq, self.rope_scaling_factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.rope_scaling is None:  # exact in fp64 (the table of rope_inv_freq is fp32)
            inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq.double(), persistent=False)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.02)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, hd] at positions [B, T], computed in fp64."""
        angles = positions.to(self.inv_freq.device).double()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return (
            (angles.cos() * self.rope_scaling_factor).to(dtype),
            (angles.sin() * self.rope_scaling_factor).to(dtype),
        )

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's taps [.., 3·H_target] (low, middle, high) → the fused state [.., H]."""
        if self.input_norm is not None:
            taps = self.input_norm(taps)
        if self.fc_norm is not None:
            taps = torch.cat([norm(tap) for norm, tap in zip(self.fc_norm, taps.chunk(NUM_TAPS, dim=-1))], dim=-1)
        return self.fc(taps)

    def project(
        self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's inputs of entries (token embeddings [B, T, H], states [B, T, H]) at
        positions [B, T] → q [B, heads, T, hd], k, v [B, kvh, T, hd] (rope applied) and the residual
        [B, T, H]. Inference (`forward`) and training (its own attention over the unrolled steps) share it."""
        cfg, layer = self.cfg, self.midlayer
        B, T, _ = embeds.shape
        normed = layer.hidden_norm(states)
        residual = normed if cfg.variant.norm_before_residual else states
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        q = layer.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = layer.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = layer.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v, residual

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual [B, T, H] and the attention's output [B, heads, T, hd] → the layer's output
        before the final norm [B, T, H]."""
        layer = self.midlayer
        B, _, T, _ = attn.shape
        h = residual + layer.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(
        self,
        embeds: torch.Tensor,
        states: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries (token embeddings [B, T, H], states [B, T, H]) at positions [B, T] attending to the
        past K/V [B, kvh, P, hd] and to each other (`mask` bool [B, 1, T, P + T], None: all) → the
        layer's output before the final norm [B, T, H] and the entries' K, V [B, kvh, T, hd]."""
        q, k, v, residual = self.project(embeds, states, positions)
        keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.finish(residual, attn), k, v

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """A step's output [.., H] → logits over the draft rows [.., draft_vocab]."""
        return self.lm_head(self.norm(out))

    def next_state(self, out: torch.Tensor) -> torch.Tensor:
        """A step's output [.., H] → the state the next step reads: the output itself, or with
        `norm_output` (EAGLE 3.1) the final-normed one the logits read."""
        return self.norm(out) if self.cfg.variant.norm_output else out

    # ----------------------------------------------------------------------------------------------
    # SpecForge / vLLM checkpoint I/O

    def file_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.state_dict().items():
            if name == "midlayer.mlp.gate_up_proj.weight":
                gate, up = t.split(self.cfg.intermediate_size, dim=0)
                out["midlayer.mlp.gate_proj.weight"], out["midlayer.mlp.up_proj.weight"] = gate, up
            else:
                out[_file_name(name)] = t
        return out

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg.to_hf()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        state = {k: v.detach().to(dtype).cpu() for k, v in self.file_state_dict().items()}
        ids = self.draft_ids if self.draft_ids is not None else torch.arange(self.cfg.draft_vocab_size)
        state["d2t"] = (ids.cpu() - torch.arange(ids.numel())).to(torch.int64)
        t2d = torch.zeros(self.cfg.vocab_size, dtype=torch.bool)
        t2d[ids.cpu()] = True
        state["t2d"] = t2d
        write_safetensors(state, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def load(
        cls, directory: str | Path, dtype: torch.dtype = torch.float32, raw: dict | None = None
    ) -> "Eagle3Drafter":
        """The drafter in `directory` (`raw`: its config.json, when the caller has read it)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise LoopspecError(f"drafter path does not exist or is not a directory: {directory}")
        if raw is None:
            raw = read_json(directory / "config.json", "drafter config")
        refuse_quantized(raw, directory)
        cfg = Eagle3Config.from_checkpoint(raw)
        weights = directory / "model.safetensors"
        files = [weights] if weights.is_file() else sorted(directory.glob("model-*-of-*.safetensors"))
        if not files:
            raise LoopspecError(f"missing EAGLE-3 drafter weights: {weights}")
        src = {}
        for f in files:
            src.update(read_safetensors(f))
        # some exports name the layer as vLLM's module does (layers.0.), or under model.
        src = {k.removeprefix("model.").replace("layers.0.", "midlayer.", 1): v for k, v in src.items()}
        # SGLang's older names of EAGLE 3.1's tap norms
        src = {OLD_TAP_NORM_NAMES.get(k, k): v for k, v in src.items()}
        d2t, t2d = src.pop("d2t", None), src.pop("t2d", None)
        if "fc.weight" not in src:
            raise LoopspecError(
                f"{directory} lacks fc.weight: an EAGLE-3 drafter fuses three target taps with fc "
                "(an EAGLE-1/2 checkpoint is not run)"
            )
        model = cls(cfg, own_embedding="embed_tokens.weight" in src)
        want = {
            _file_name(n): tuple(t.shape)
            for n, t in model.state_dict().items()
            if n != "midlayer.mlp.gate_up_proj.weight"
        }
        I, H = cfg.intermediate_size, cfg.hidden_size
        want.update({"midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H)})
        missing = sorted(set(want) - set(src))
        unexpected = sorted(set(src) - set(want))
        if missing or unexpected:
            raise LoopspecError(
                "EAGLE-3 weights do not match the format: "
                + "; ".join(
                    x
                    for x in (
                        f"missing {', '.join(missing)}" if missing else "",
                        f"unexpected {', '.join(unexpected)}" if unexpected else "",
                    )
                    if x
                )
            )
        for name, shape in want.items():
            if tuple(src[name].shape) != shape:
                raise LoopspecError(
                    f"EAGLE-3 weights do not match its config.json: {name} is "
                    f"{list(src[name].shape)} in the file, the config makes it {list(shape)}"
                )
            if not torch.is_floating_point(src[name]):
                raise LoopspecError(f"EAGLE-3 tensor {name} has non-float dtype {src[name].dtype}")
        state = {}
        for n in model.state_dict():
            if n == "midlayer.mlp.gate_up_proj.weight":
                state[n] = torch.cat([src["midlayer.mlp.gate_proj.weight"], src["midlayer.mlp.up_proj.weight"]])
            else:
                state[n] = src[_file_name(n)]
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        model.draft_ids = draft_ids(cfg, d2t, t2d, directory)
        return model.to(dtype).eval()


def draft_ids(cfg: Eagle3Config, d2t: torch.Tensor | None, t2d: torch.Tensor | None, where) -> torch.Tensor | None:
    """The target id of every draft row from d2t (target = draft + d2t[draft]), checked against t2d;
    None for a full draft vocabulary mapped to itself."""
    if d2t is None or t2d is None:
        if cfg.draft_vocab_size < cfg.vocab_size or (d2t is None) != (t2d is None):
            raise LoopspecError(
                f"{where} lacks {'d2t' if d2t is None else 't2d'}: a draft vocabulary of "
                f"{cfg.draft_vocab_size} rows over a target vocabulary of {cfg.vocab_size} needs "
                "both maps (d2t: draft id → target id offset, t2d: the target ids covered)"
            )
        return None
    if d2t.dim() != 1 or d2t.numel() != cfg.draft_vocab_size or d2t.dtype.is_floating_point:
        raise LoopspecError(
            f"{where}: d2t must be an integer vector of draft_vocab_size {cfg.draft_vocab_size}, "
            f"got {d2t.dtype} {list(d2t.shape)}"
        )
    if t2d.dim() != 1 or t2d.numel() != cfg.vocab_size or t2d.dtype != torch.bool:
        raise LoopspecError(
            f"{where}: t2d must be a bool vector of vocab_size {cfg.vocab_size}, got {t2d.dtype} {list(t2d.shape)}"
        )
    ids = torch.arange(d2t.numel()) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise LoopspecError(
            f"{where}: d2t maps draft rows to target ids {int(ids.min())}..{int(ids.max())}, "
            f"outside the target's vocabulary of {cfg.vocab_size}"
        )
    if ids.unique().numel() != ids.numel():
        raise LoopspecError(f"{where}: d2t maps two draft rows to one target id")
    covered = torch.zeros_like(t2d)
    covered[ids] = True
    if not torch.equal(covered, t2d):
        raise LoopspecError(f"{where}: t2d marks {int(t2d.sum())} target ids, not the {ids.numel()} d2t maps to")
    return None if torch.equal(ids, torch.arange(cfg.vocab_size)) else ids


def fresh_eagle3(
    target: TargetConfig,
    block_size: int = DEFAULT_BLOCK_SIZE,
    draft_ids: torch.Tensor | None = None,
    intermediate_size: int | None = None,
    target_layer_ids: list[int] | None = None,
) -> Eagle3Drafter:
    """An untrained EAGLE-3 drafter shaped for `target` (its taps `target_layer_ids`, loopspec's
    numbering; None: vLLM's default)."""
    cfg = Eagle3Config(
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        vocab_size=target.vocab_size,
        draft_vocab_size=target.vocab_size if draft_ids is None else int(draft_ids.numel()),
        target_layer_ids=target_layer_ids,
        block_size=block_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
    )
    cfg.fit(target)
    model = Eagle3Drafter(cfg)
    model.draft_ids = draft_ids
    return model
