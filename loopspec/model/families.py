"""The target families: one record per checkpoint `model_type`, looked up, never re-tested elsewhere.

A record reads its family's `config.json` into a TargetConfig and says what the rest of loopspec may
do with it: whether the exported graphs (ONNX, the GGUF's own blocks) build it, and whether draft
trees verify exactly on it. The decoder layers themselves are chosen from the config's values
(`layer_modules`): the attention (full, windowed, with sinks), a family's linear attention, and
the feed-forward (dense SwiGLU or a mixture of experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from loopspec.errors import LoopspecError
from loopspec.model.experts import ExpertsConfig, SparseExperts
from loopspec.model.qwen3_5 import GatedDeltaNet, read_qwen3_5_config
from loopspec.model.target import MLP, Target, TargetAttention, TargetConfig, TargetLayer, dense_config


@dataclass(frozen=True)
class TargetFamily:
    model_type: str
    read_config: Callable[[dict], TargetConfig]  # HF config.json dict → TargetConfig
    checkpoint: str  # how its tensors are laid out (loopspec.weights reads each layout)
    exported: bool  # engines/export.py builds its ONNX / GGUF-block graphs
    trees: bool = True  # draft trees verify exactly (a recurrent state follows one path: chains only)


def _layer_types(hf: dict) -> dict:
    """layer_types / sliding_window as a config declares them (Qwen2/Qwen3 with use_sliding_window too)."""
    types = hf.get("layer_types")
    if types is None or all(t == "full_attention" for t in types):
        return {}
    return dict(layer_types=list(types), sliding_window=hf.get("sliding_window"))


def _llama(hf: dict) -> TargetConfig:
    return dense_config(hf, **_layer_types(hf))


def _qwen2(hf: dict) -> TargetConfig:
    return dense_config(hf, attention_bias=True, **_layer_types(hf))


def _qwen3(hf: dict) -> TargetConfig:
    return dense_config(hf, qk_norm=True, **_layer_types(hf))


def _qwen3_moe(hf: dict) -> TargetConfig:
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    for key, value in (
        ("num_experts", num_experts),
        ("num_experts_per_tok", hf.get("num_experts_per_tok")),
        ("moe_intermediate_size", hf.get("moe_intermediate_size")),
    ):
        if not isinstance(value, int) or value < 1:
            raise LoopspecError(f"qwen3_moe config.json needs a positive integer {key}, got {value!r}")
    step, dense_layers = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    layers = hf.get("num_hidden_layers", 0)
    sparse = tuple(i for i in range(layers) if i not in dense_layers and (i + 1) % step == 0)
    experts = ExpertsConfig(
        num_experts,
        hf["num_experts_per_tok"],
        hf["moe_intermediate_size"],
        sparse,
        routing="softmax_topk",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
    return dense_config(hf, qk_norm=True, experts=experts, **_layer_types(hf))


def _gpt_oss(hf: dict) -> TargetConfig:
    layers = hf.get("num_hidden_layers", 0)
    experts = ExpertsConfig(
        hf.get("num_local_experts", 0),
        hf.get("num_experts_per_tok", 0),
        hf.get("intermediate_size", 0),
        tuple(range(layers)),
        routing="topk_softmax",
        bias=True,
        activation="clamped_swiglu",
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return dense_config(
        hf,
        attention_bias=True,
        attention_sinks=True,
        experts=experts,
        layer_types=list(types),
        sliding_window=hf.get("sliding_window"),
    )


FAMILIES: dict[str, TargetFamily] = {
    f.model_type: f
    for f in (
        TargetFamily("llama", _llama, "dense", exported=True),
        TargetFamily("qwen2", _qwen2, "dense", exported=True),
        TargetFamily("qwen3", _qwen3, "dense", exported=True),
        TargetFamily("qwen3_moe", _qwen3_moe, "qwen3_moe", exported=False),
        TargetFamily("gpt_oss", _gpt_oss, "gpt_oss", exported=False),
        # Qwen3.5: published as the multimodal model (its decoder under text_config and model.language_model.),
        # saved text-only as qwen3_5_text; both read as family qwen3_5 (Qwen3.5-MoE: qwen3_5_moe)
        TargetFamily("qwen3_5", read_qwen3_5_config, "qwen3_5", exported=False, trees=False),
        TargetFamily("qwen3_5_text", read_qwen3_5_config, "qwen3_5", exported=False, trees=False),
        TargetFamily("qwen3_5_moe", read_qwen3_5_config, "qwen3_5", exported=False, trees=False),
        TargetFamily("qwen3_5_moe_text", read_qwen3_5_config, "qwen3_5", exported=False, trees=False),
        # Qwen3-Next: the same decoder, its linear-attention projections fused per key-head group
        TargetFamily("qwen3_next", read_qwen3_5_config, "qwen3_next", exported=False, trees=False),
    )
}


def target_family(model_type: str | None) -> TargetFamily:
    if model_type not in FAMILIES:
        raise LoopspecError(f"unsupported architecture {model_type!r} (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def target_config(hf: dict) -> TargetConfig:
    return target_family(hf.get("model_type")).read_config(hf)


def export_refusal(cfg: TargetConfig, backend: str) -> str | None:
    """Why the exported graphs cannot run this target on `backend` (one line), or None when they can:
    they build dense full-attention decoders only."""
    family = target_family(cfg.family)
    if family.exported and all(cfg.layer_type(i) == "full_attention" for i in range(cfg.num_layers)):
        return None
    what = "sliding-window layers" if family.exported else f"{cfg.family} targets"
    dense = ", ".join(name for name, f in FAMILIES.items() if f.exported)
    return (
        f"the {backend} engine is not built for {what} (its graphs cover full-attention {dense}); "
        f"run this target with --backend torch"
    )


def new_target(cfg: TargetConfig, target_layer_ids: list[int] | None = None) -> Target:
    """A Target of `cfg`'s family (weights uninitialised: load them)."""
    target_family(cfg.family)
    return Target(cfg, [TargetLayer(cfg, i, *layer_modules(cfg, i)) for i in range(cfg.num_layers)], target_layer_ids)


def layer_modules(cfg: TargetConfig, index: int) -> tuple[nn.Module, nn.Module]:
    """Layer `index`'s token mixer and feed-forward, as the config declares them."""
    kind = cfg.layer_type(index)
    if kind == "linear_attention":
        mixer = GatedDeltaNet(cfg)
    else:
        mixer = TargetAttention(cfg, window=cfg.sliding_window if kind == "sliding_attention" else None)
    experts: ExpertsConfig | None = cfg.experts
    if experts is not None and index in experts.sparse_layers:
        return mixer, SparseExperts(cfg.hidden_size, experts)
    return mixer, MLP(cfg.hidden_size, cfg.intermediate_size)
