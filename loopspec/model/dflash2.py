"""DFlash2 drafters: z-lab's DFlash block drafter with grouped dynamic convolutions and a candidate
selector, in z-lab's checkpoint layout (`architectures: ["DFlash2DraftModel"]`, as vLLM's `dflash`
method, SGLang and llama.cpp load it).

The format (config.json and model.safetensors, beside every DFlash field and tensor):
- `dflash_config` (each field read there first, then at the top level): `block_size`,
  `conv_kernel_size` (taps), `conv_group_size` (channels sharing one dynamic coefficient),
  `selector_rank`, `selector_top_k`, and optionally `output_multiplier` (1), `final_logit_softcapping`
  (none), `input_embedding_scale` (1). At the top level: `is_causal` (false as published: the block
  is bidirectional; absent: causal on sliding layers), `layer_types` and `sliding_window`.
- per layer, one convolution around each sublayer: `layers.i.attention_conv.base_kernel` and
  `layers.i.mlp_conv.base_kernel` [2, taps, H], `….kernel_projection.weight` [2·taps·G, H] with
  G = H / conv_group_size;
- `candidate_selector.hidden_projection.weight` [rank, H], `candidate_selector.predecessor_codebook`
  and `candidate_selector.successor_codebook` [V, rank] (no `.weight` suffix).

A layer: x_n = norm(x); d = kernel_projection(x_n) viewed [.., 2, taps, G] (per token);
x = x + conv(sublayer(conv(x_n, base[0], d[0])), base[1], d[1]), once around attention and once
around the MLP, where conv(y, b, e)[t] = Σ_o (b[o] + e[t, o] over its group's channels) ⊙ y[t - o],
causal inside the block with zeros before its first slot. The attention's queries and the block's own
keys/values read the convolved states; the context's keys/values are DFlash's.

The draft step: the final-norm states h of block positions 1..k-1 (z-lab's block), the target's
head over them times `output_multiplier` (then soft-capped) give each slot's top-k candidates c and
their logits (the unary term). With u = hidden_projection(h), the walk goes left to right from the
anchor: slot i scores candidate c after the token p chosen before it (the anchor first) as
unary[c] + ⟨predecessor_codebook[p] ⊙ u_i, successor_codebook[c]⟩ and takes the argmax (ties: the
higher-ranked candidate); at T > 0 it draws from q_i = softmax(score / T) over the k candidates
(zero elsewhere), the q that speculative sampling accepts against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.decoding import SamplingParams, probabilities, sample
from loopspec.errors import LoopspecError
from loopspec.files import read_json, refuse_quantized, write_safetensors
from loopspec.model.draft_head import DRAFT_CANDIDATES, StageDrafts
from loopspec.model.dflash import D2T_FILE, Drafter, DrafterAttention, DrafterConfig, drafter_tensors
from loopspec.model.drafter_kinds import ARCHITECTURE, DFLASH2_ARCHITECTURE, DrafterKind, SelectorKind, dflash2_kind
from loopspec.model.target import MLP, RMSNorm
from loopspec.tree import Lattice

LAYER_TYPES = ("full_attention", "sliding_attention")
_REQUIRED = object()


@dataclass
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2  # taps of each grouped dynamic convolution
    conv_group_size: int = 16  # channels that share one dynamic coefficient
    selector_rank: int = 256
    selector_top_k: int = 16  # candidates per block slot (the target head's top-k)
    output_multiplier: float = 1.0  # scales the head's logits before the top-k
    final_logit_softcapping: float | None = None  # tanh(z / cap) * cap of the scaled logits
    input_embedding_scale: float = 1.0  # scales the block's token embeddings
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer, LAYER_TYPES (empty: every layer full attention)
    is_causal: bool | None = False  # the block's own keys: causal or all (None: causal on sliding layers)

    def __post_init__(self):
        super().__post_init__()
        problems = []
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems:
            if self.hidden_size % self.conv_group_size:
                problems.append(
                    f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
                )
            if self.selector_top_k > self.vocab_size:
                problems.append(
                    f"selector_top_k {self.selector_top_k} is larger than the vocabulary of {self.vocab_size}"
                )
        if not self.output_multiplier > 0:  # a negative one would turn the top-k into the bottom-k
            problems.append(f"output_multiplier must be > 0, got {self.output_multiplier!r}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            problems.append(f"final_logit_softcapping must be > 0 (or absent), got {self.final_logit_softcapping!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            problems.append(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.layer_types and (
            len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            problems.append(
                f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                f"{self.num_layers} layers, got {list(self.layer_types)}"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            problems.append("sliding_attention layers need a sliding_window")
        if self.anchor_predicts or self.markov_rank or self.confidence_head:
            problems.append("a DFlash2 drafter drafts in z-lab's block convention, with no DSpark head")
        if problems:
            raise LoopspecError("DFlash2 drafter config: " + "; ".join(problems))

    @property
    def kind(self) -> DrafterKind:
        return dflash2_kind(
            SelectorKind(
                self.conv_kernel_size,
                self.conv_group_size,
                self.selector_rank,
                self.selector_top_k,
                self.hidden_size,
                self.input_embedding_scale,
            )
        )

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: it sees every context position)."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def layer_causal(self, layer: int) -> bool:
        """Whether layer `layer`'s block queries see only the block keys up to their own."""
        if self.is_causal is None:  # z-lab's reading of a config without is_causal
            return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return self.is_causal

    @classmethod
    def over(cls, base: DrafterConfig, **dflash2_fields) -> "DFlash2Config":
        """A DFlash2 config with `base`'s DFlash fields (`DrafterConfig.for_target`'s, or a checkpoint's)."""
        return cls(**{f.name: getattr(base, f.name) for f in fields(DrafterConfig)}, **dflash2_fields)

    @classmethod
    def from_checkpoint(cls, raw: dict) -> "DFlash2Config":
        """Read a DFlash2 config.json (module docstring); its DFlash fields as `DrafterConfig.from_checkpoint` does."""
        if not isinstance(raw, dict):
            raise LoopspecError(f"drafter config.json must hold a JSON object, got {type(raw).__name__}")
        if DFLASH2_ARCHITECTURE not in (raw.get("architectures") or []):
            raise LoopspecError(f"not a DFlash2 drafter: architectures={raw.get('architectures')}")
        draft = raw.get("dflash_config") or {}
        if not isinstance(draft, dict):
            raise LoopspecError("drafter config.json: dflash_config must be an object")

        def field(name, default=_REQUIRED):
            value = draft[name] if name in draft else raw.get(name, default)
            if value is _REQUIRED:
                raise LoopspecError(f"DFlash2 drafter config.json lacks dflash_config.{name}")
            return value

        base = DrafterConfig.from_checkpoint(
            {**raw, "architectures": [ARCHITECTURE], "block_size": field("block_size", 16)}
        )
        softcap = field("final_logit_softcapping", None)
        # as transformers' Qwen3 config reads them: no window without use_sliding_window, and without
        # layer_types the layers from max_window_layers on slide
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        layer_types = raw.get("layer_types")
        if layer_types is None:
            first = raw.get("max_window_layers", 28)
            layer_types = [LAYER_TYPES[window is not None and i >= first] for i in range(base.num_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise LoopspecError(f"drafter config.json: layer_types must be a list, got {layer_types!r}")
        if window is None:  # no window: every layer sees the whole context
            layer_types = ()
        causal = raw.get("is_causal")
        if causal is not None and not isinstance(causal, bool):
            raise LoopspecError(f"drafter config.json: is_causal must be true or false, got {causal!r}")
        numbers = {}
        for name in ("output_multiplier", "input_embedding_scale"):
            numbers[name] = field(name, 1.0)
            if not isinstance(numbers[name], (int, float)) or isinstance(numbers[name], bool):
                raise LoopspecError(f"drafter config.json: {name} must be a number, got {numbers[name]!r}")
        if softcap is not None and (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)):
            raise LoopspecError(f"drafter config.json: final_logit_softcapping must be a number, got {softcap!r}")
        return cls.over(
            base,
            conv_kernel_size=field("conv_kernel_size"),
            conv_group_size=field("conv_group_size"),
            selector_rank=field("selector_rank"),
            selector_top_k=field("selector_top_k"),
            output_multiplier=float(numbers["output_multiplier"]),
            final_logit_softcapping=float(softcap) if softcap else None,  # 0: none, as z-lab reads it
            input_embedding_scale=float(numbers["input_embedding_scale"]),
            sliding_window=window,
            layer_types=tuple(layer_types),
            is_causal=causal,
        )

    def to_zlab(self) -> dict:
        """config.json as z-lab writes a DFlash2 drafter, which every DFlash2 reader loads (an exported
        artifact's drafter/config.json too: loopspec.model.drafters `drafter_config` reads it back)."""
        return self.to_checkpoint()

    def to_checkpoint(self) -> dict:
        """config.json as z-lab writes a DFlash2 drafter (`from_checkpoint` reads it back)."""
        cfg = DrafterConfig.to_zlab(self)
        cfg["architectures"] = [DFLASH2_ARCHITECTURE]
        cfg["dflash_config"].update(
            block_size=self.block_size,
            conv_kernel_size=self.conv_kernel_size,
            conv_group_size=self.conv_group_size,
            selector_rank=self.selector_rank,
            selector_top_k=self.selector_top_k,
            output_multiplier=self.output_multiplier,
            input_embedding_scale=self.input_embedding_scale,
        )
        if self.final_logit_softcapping is not None:
            cfg["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        cfg["use_sliding_window"] = self.sliding_window is not None
        if self.sliding_window is not None:
            cfg["sliding_window"] = self.sliding_window
        if self.layer_types:
            cfg["layer_types"] = list(self.layer_types)
        return cfg


# --------------------------------------------------------------------------------------------------
# the convolution


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """One block per row: x [B, T, H], dynamic coefficients [B, T, taps, G], base kernel [taps, H] →
    y [B, T, H], y[t] = Σ_o (base[o] + dynamic[t, o] over its group's channels) ⊙ x[t - o]; causal,
    with zeros before the block's first slot (the coefficients are the output position's)."""
    B, T, H = x.shape
    taps, groups = base.shape[0], H // group_size
    blocks = x.view(B, T, groups, group_size)
    out = torch.zeros_like(blocks)
    for offset in range(min(taps, T)):
        shifted = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))  # x[t - offset]
        coefficients = base[offset].view(1, 1, groups, group_size).to(x.dtype) + dynamic[:, :, offset, :, None]
        out = out + coefficients * shifted
    return out.view(B, T, H)


class GroupedDynamicConv(nn.Module):
    """The convolution around one sublayer: `prepare` convolves its input with base_kernel[0] and the
    first half of the token's dynamic coefficients, `finish` its output with base_kernel[1] and the
    second half (both halves projected from the sublayer's normed input)."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.taps, self.group_size = cfg.conv_kernel_size, cfg.conv_group_size
        self.groups = cfg.hidden_size // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, cfg.hidden_size))
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * self.taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)  # [B, T, 2, taps, G]
        return grouped_dynamic_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size), dynamic[
            ..., 1, :, :
        ]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, dynamic, self.base_kernel[1], self.group_size)


class DFlash2Layer(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.attention_conv = GroupedDynamicConv(cfg)
        self.mlp_conv = GroupedDynamicConv(cfg)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        h, dynamic = self.attention_conv.prepare(self.input_layernorm(x))  # [B, k, H], [B, k, taps, G]
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, ctx_k, ctx_v, mask), dynamic)
        h, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dynamic)


# --------------------------------------------------------------------------------------------------
# the selector


class CandidateSelector(nn.Module):
    """Scores the edge from a predecessor p to a candidate c at a slot whose state h projects to u:
    ⟨predecessor_codebook[p] ⊙ u, successor_codebook[c]⟩ (added to c's unary logit by the walk)."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def edges(self, previous: torch.Tensor, projected: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """previous [R] token ids, projected [R, rank] (u of the slot), candidates [R, K] → [R, K]."""
        # F.embedding rather than indexing: the same rows, and a backward that sums a token's repeats in a
        # fixed order (indexing's accumulates them in parallel: training would not repeat bit for bit)
        gated = F.embedding(previous, self.predecessor_codebook) * projected  # [R, rank]
        # a product and a sum per row (no batched matmul): a row scores alone what it scores batched
        return (gated[:, None, :] * F.embedding(candidates, self.successor_codebook)).sum(-1)  # [R, K]


class DFlash2Drafter(Drafter):
    layer_class = DFlash2Layer
    config_class = DFlash2Config

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)  # every Linear N(0, 0.02), as a fresh DFlash drafter
        self.candidate_selector = CandidateSelector(cfg)
        with torch.no_grad():  # a fresh drafter's convolutions pass their input through unchanged
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
            for codebook in (self.candidate_selector.predecessor_codebook, self.candidate_selector.successor_codebook):
                codebook.normal_(0.0, 0.02)
            self.candidate_selector.hidden_projection.weight.normal_(0.0, 0.02)

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `Drafter.forward` (one block per row: the convolutions run along it), the embeddings
        scaled by input_embedding_scale and each layer's window and block causality applied."""
        cos, sin = self.rotary(positions)
        if cos.dim() == 2:
            cos, sin = cos[None, None], sin[None, None]
        x = block_embeds * self.cfg.input_embedding_scale if self.cfg.input_embedding_scale != 1.0 else block_embeds
        masks = self.layer_masks(positions, ctx_k.shape[-2], x.shape[1], mask)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], masks[i])
        return self.norm(x)

    def stage_drafts(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        head,
        draft_ids: torch.Tensor | None,
        sampling: list | None = None,
    ) -> StageDrafts:
        """One stage's drafts: its candidate selector's walk over the head's top-k per slot
        (`selector_stage`; a DFlash2 drafter drafts over the whole vocabulary: `draft_ids` is None)."""
        return selector_stage(self, hidden, anchors, head, sampling)

    def layer_masks(
        self, positions: torch.Tensor, context: int, k: int, mask: torch.Tensor | None
    ) -> list[torch.Tensor | None]:
        """Each layer's attention mask over [context ; block] (bool, True: seen), `mask` (the engine's:
        stale context slots hidden) with the layer's window and causality. Context slot j holds
        position j (the engines' contexts do); the block's slots are at `positions`."""
        rules = [(self.cfg.layer_window(i), self.cfg.layer_causal(i)) for i in range(self.cfg.num_layers)]
        queries = positions.reshape(-1, k)  # [R or 1, k]
        built: dict[tuple, torch.Tensor | None] = {(None, False): mask}
        for window, causal in rules:
            if (window, causal) in built:
                continue
            keys = torch.cat(
                [torch.arange(context, device=queries.device).expand(queries.shape[0], context), queries], dim=1
            )  # [R, C + k] positions
            seen = torch.ones(queries.shape[0], k, context + k, dtype=torch.bool, device=queries.device)
            if window is not None:  # z-lab's window both ways: |query - key| < window
                seen &= (queries[:, :, None] - keys[:, None, :]).abs() < window
            if causal:
                seen[:, :, context:] &= torch.ones(k, k, dtype=torch.bool, device=queries.device).tril()
            built[(window, causal)] = seen[:, None] if mask is None else seen[:, None] & mask  # [R, 1, k, C + k]
        return [built[rule] for rule in rules]

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target head's logits [..., V] as the selector reads them: scaled, then soft-capped."""
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    def grow(self, num_layers: int) -> "Drafter":
        raise LoopspecError(
            f"a DFlash2 drafter cannot be deepened (--num-layers {num_layers}): deepen the DFlash "
            "drafter it starts from (--init a DFlash drafter with --family dflash2)"
        )

    @classmethod
    def from_dflash(cls, base: Drafter, **dflash2_fields) -> "DFlash2Drafter":
        """A DFlash2 drafter that drafts as the z-lab DFlash drafter `base`: its layers, fc and norms
        loaded, the convolutions identities (a fresh drafter's), and the successor codebook zero, so
        every edge scores 0 and the walk takes each slot's top unary candidate, the DFlash argmax
        (SpecForge starts a selector so: its score is the unary one until training moves it). A reduced
        draft vocabulary (d2t) is left behind: the selector reads the target head over the whole
        vocabulary, so the start drafts as `base` would over the whole vocabulary."""
        if not base.cfg.kind.plain:
            raise LoopspecError(
                f"a DFlash2 drafter starts from a z-lab DFlash drafter, not this {base.cfg.kind.title} drafter"
            )
        p = base.fc.weight
        cfg = DFlash2Config.over(base.cfg, **dflash2_fields)
        cfg.extra = {k: v for k, v in base.cfg.extra.items() if k != "draft_vocab_size"}
        drafter = cls(cfg).to(p.dtype)
        missing, unexpected = drafter.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected and all(
            ".attention_conv." in k or ".mlp_conv." in k or k.startswith("candidate_selector.") for k in missing
        ), (missing, unexpected)
        with torch.no_grad():
            drafter.candidate_selector.successor_codebook.zero_()
        return drafter.to(p.device).train(base.training)

    def with_heads(self, heads) -> "Drafter":
        raise LoopspecError("a DFlash2 drafter takes no DSpark heads (its draft step is the candidate selector)")

    # ----------------------------------------------------------------------------------------------
    # z-lab's checkpoint layout

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg.to_checkpoint()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        write_safetensors(
            {k: v.detach().to(dtype).cpu() for k, v in self.zlab_state_dict().items()}, directory / "model.safetensors"
        )
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def load(
        cls, directory: str | Path, dtype: torch.dtype = torch.float32, raw: dict | None = None
    ) -> "DFlash2Drafter":
        """The drafter in `directory` (`raw`: its config.json, when the caller has read it)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise LoopspecError(f"drafter path does not exist or is not a directory: {directory}")
        if raw is None:
            raw = read_json(directory / "config.json", "drafter config")
        refuse_quantized(raw, directory)
        cfg = DFlash2Config.from_checkpoint(raw)
        if (directory / D2T_FILE).is_file():
            raise LoopspecError(
                f"{directory / D2T_FILE}: a DFlash2 drafter selects among the target head's top-k "
                "over the whole vocabulary; a reduced draft vocabulary does not apply to it"
            )
        state = drafter_tensors(directory, cfg.num_layers)
        # the config's sizes against the file's tensors on the meta device (no memory) before any is allocated
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in cls(cfg).state_dict().items()}
        missing = sorted(set(shapes) - set(state))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise LoopspecError(f"DFlash2 drafter {directory} lacks {missing[0]}{more}")
        extra = sorted(set(state) - set(shapes))
        if extra:
            raise LoopspecError(f"DFlash2 drafter {directory} holds {extra[0]}, which its config.json does not make")
        for name, shape in shapes.items():
            if tuple(state[name].shape) != shape:
                raise LoopspecError(
                    f"DFlash2 drafter weights do not match its config.json: size mismatch for {name}: "
                    f"{list(state[name].shape)} in the file, the config makes it {list(shape)}"
                )
            if not torch.is_floating_point(state[name]):
                raise LoopspecError(f"drafter tensor {name} has non-float dtype {state[name].dtype}")
        model = cls(cfg)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        return model.to(dtype).eval()


# --------------------------------------------------------------------------------------------------
# the draft step


def selector_stage(
    drafter: DFlash2Drafter,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    head,
    sampling: list[tuple[SamplingParams, torch.Generator]] | None = None,
) -> StageDrafts:
    """One stage's drafts from its block's final-norm states hidden [R, k, H] (anchors [R], `head`
    the target's lm_head) by the selector's walk (module docstring).

    Without `sampling`: the walk's argmax path as rank 0 of each slot's candidates [R, D, C], the
    slot's other candidates ranked by their scores given the same predecessor, and log-softmax of
    those scores [R, D, C]; and the selector's whole lattice (`selector_lattice`), over which a
    draft tree takes its best paths, each node's children scored after the node's own token.
    With `sampling` (each row's params and generator): each row draws its slot from
    q = softmax(score / T) over the slot's candidates (a greedy row takes the argmax, q one-hot) →
    drafts [R, D, 1], log q [R, D, 1] and q [R, D, V] on the CPU."""
    cfg = drafter.cfg
    states = hidden[:, cfg.first_draft :]  # [R, D, H]
    unary, candidates = drafter.unary_logits(head(states)).topk(cfg.selector_top_k, dim=-1)  # [R, D, K], descending
    selector = drafter.candidate_selector
    projected = selector.hidden_projection(states)  # [R, D, rank]
    R, D, K = candidates.shape
    previous = anchors
    chosen, scores = [], []
    q = torch.zeros(R, D, cfg.vocab_size) if sampling is not None else None
    for i in range(D):
        score = unary[:, i] + selector.edges(previous, projected[:, i], candidates[:, i])  # [R, K]
        if sampling is None:
            index = score.sort(dim=-1, descending=True, stable=True).indices[:, 0]  # ties: the higher-ranked
        else:
            index = torch.empty(R, dtype=torch.long)
            host = score.float().cpu()
            for r, (params, generator) in enumerate(sampling):
                if params.greedy:
                    index[r] = host[r].sort(descending=True, stable=True).indices[0]
                    law = torch.zeros(K).index_fill_(0, index[r : r + 1], 1.0)
                else:
                    law = probabilities(host[r], SamplingParams(temperature=params.temperature))  # [K]
                    index[r] = sample(law, generator)
                q[r, i, candidates[r, i].cpu()] = law
            index = index.to(score.device)
        previous = candidates[:, i].gather(-1, index[:, None])[:, 0]  # [R]
        chosen.append(previous)
        scores.append(score)
    if sampling is not None:
        drafts = torch.stack(chosen, dim=1).cpu()[..., None]  # [R, D, 1]
        return StageDrafts(drafts, q.gather(-1, drafts).log(), hidden, None, q)
    scores = torch.stack(scores, dim=1)  # [R, D, K]
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(DRAFT_CANDIDATES, K)]  # [R, D, C]
    drafts = candidates.gather(-1, order)
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, order)
    return StageDrafts(
        drafts.cpu(),
        logprobs.float().cpu(),
        hidden,
        lattice=selector_lattice(selector, unary, candidates, projected, anchors),
    )


def selector_lattice(
    selector: CandidateSelector,
    unary: torch.Tensor,
    candidates: torch.Tensor,
    projected: torch.Tensor,
    anchors: torch.Tensor,
) -> Lattice:
    """The selector's whole lattice of a stage (loopspec.tree.Lattice): every slot's candidates
    [R, D, K] and, for every candidate a of the slot before (the anchor at slot 0), the log-softmax
    over the slot's candidates b of unary[b] + edge(a → b) [R, D, K, K] — the walk's score from any
    predecessor, not only the one it took. Scored by the walk's own `edges`, one (predecessor, slot)
    pair per row of it."""
    R, D, K = candidates.shape
    first = torch.full((R, K, K), float("-inf"), dtype=torch.float64)  # slot 0: only the anchor leads in
    first[:, 0] = (
        torch.log_softmax(unary[:, 0] + selector.edges(anchors, projected[:, 0], candidates[:, 0]), dim=-1)
        .double()
        .cpu()
    )
    slots = [first]
    for i in range(1, D):
        edges = selector.edges(
            candidates[:, i - 1].reshape(-1),
            projected[:, i].repeat_interleave(K, dim=0),
            candidates[:, i].repeat_interleave(K, dim=0),
        ).view(R, K, K)  # [R, a, b]
        slots.append(torch.log_softmax(unary[:, i, None, :] + edges, dim=-1).double().cpu())
    return Lattice(candidates.cpu(), torch.stack(slots, dim=1))
