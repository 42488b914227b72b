"""Quantized checkpoints in the layout TensorRT-LLM, vLLM and SGLang load, and a check of that layout.

modelopt's `export_hf_checkpoint` needs a transformers `PreTrainedModel` (it reads `model.config` and
calls `save_pretrained`); loopspec's drafter and target are plain modules, so the checkpoints are
assembled here from the tensors modelopt's export primitives compute (`QuantizedWeight`, see
convert/quantize.py) and modelopt's own quantization config (`get_quant_config`,
`convert_hf_quant_config_format`):

- drafter: the z-lab DFlash layout (config.json with `dflash_config`, model.safetensors without
  embedding or lm_head, d2t.safetensors when it drafts over a reduced vocabulary);
- target: the Hugging Face layout (`model.` prefix, lm_head at the top, the source's config.json and
  tokenizer files);
- both: fused modules split back (qkv_proj → q/k/v_proj, gate_up_proj → gate/up_proj), quantized linears
  as FP8 `weight` float8_e4m3fn + `weight_scale` / `input_scale` fp32 scalars, or NVFP4 `weight` uint8
  [out, in/2] (two e2m1 per byte, low nibble first) + `weight_scale` float8_e4m3fn [out, in/16] +
  `weight_scale_2` / `input_scale` fp32 scalars; the rest in bf16; `hf_quant_config.json` and
  `quantization_config` in config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from loopspec.convert.qdq import NVFP4_BLOCK
from loopspec.convert.quant_weights import UNQUANTIZED_DTYPE, quantized_weight
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.model.target import Target

# Fused modules of loopspec's models → the Hugging Face modules they hold, in row order.
HF_SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def hf_state(model: nn.Module, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under Hugging Face names: quantized linears in deployment form, fused
    modules split back (qkv_proj → q/k/v_proj, gate_up_proj → gate/up_proj), the rest in bf16."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if name in skip or "weight" not in own:
            continue
        leaf = name.rsplit(".", 1)[-1]
        q = quantized_weight(module) if isinstance(module, nn.Linear) and hasattr(module, "weight_quantizer") else None
        if q is None:
            plain = {k: v.detach().to(UNQUANTIZED_DTYPE) for k, v in own.items()}  # weight (+ bias)
        parts = HF_SPLITS.get(leaf) if isinstance(module, nn.Linear) else None
        if parts is None:
            state.update(
                q.tensors(prefix + name + ".")
                if q is not None
                else {prefix + name + "." + k: v for k, v in plain.items()}
            )
            continue
        start, base = 0, prefix + name.removesuffix(leaf)
        for part, size in zip(parts, _split_sizes(model, name, module)):
            state.update(
                q.rows(start, start + size).tensors(base + part + ".")
                if q is not None
                else {base + part + "." + k: v[start : start + size] for k, v in plain.items()}
            )
            start += size
    return {k: v.contiguous() for k, v in state.items()}


def _split_sizes(model: nn.Module, name: str, module: nn.Module) -> tuple[int, ...]:
    """Output rows of each part of a fused module."""
    if name.endswith("gate_up_proj"):
        half = module.weight.shape[0] // 2
        return (half, half)
    parent = model.get_submodule(name.rsplit(".", 1)[0])
    return tuple(parent.split)  # TargetAttention: (q_out, kv_out, kv_out)


def hf_quant_configs(model: nn.Module, prefix: str = "") -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json's quantization_config), both from modelopt; excluded module
    names under the checkpoint's names (`prefix`, except lm_head which sits at the top in HF)."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import get_quant_config

    quant = get_quant_config(model)
    excluded = quant["quantization"].get("exclude_modules") or []
    quant["quantization"]["exclude_modules"] = [n if n.startswith("lm_head") else prefix + n for n in excluded]
    return quant, convert_hf_quant_config_format(quant)


def export_drafter_checkpoint(qdrafter: Drafter, out_dir: str | Path) -> Path:
    """The calibrated drafter as a z-lab checkpoint (config.json + model.safetensors [+ d2t])."""
    from loopspec.weights import write_safetensors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = hf_state(qdrafter)
    write_safetensors(state, out_dir / "model.safetensors")
    quant, quantization_config = hf_quant_configs(qdrafter)
    cfg = qdrafter.cfg.to_zlab()
    cfg["torch_dtype"] = str(UNQUANTIZED_DTYPE).removeprefix("torch.")
    cfg["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "hf_quant_config.json").write_text(json.dumps(quant, indent=2) + "\n")
    qdrafter.save_d2t(out_dir)
    return out_dir


def export_target_checkpoint(qtarget: Target, source_dir: str | Path, out_dir: str | Path) -> Path:
    """The calibrated target as a Hugging Face checkpoint: the source's config.json + quantization_config,
    model.safetensors under HF names, hf_quant_config.json and the source's tokenizer files."""
    from loopspec.weights import read_json, write_safetensors

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tied = qtarget.cfg.tie_word_embeddings
    state = hf_state(qtarget, prefix="model.", skip=("lm_head",))
    if not tied:
        lm_head = quantized_weight(qtarget.lm_head) if hasattr(qtarget.lm_head, "weight_quantizer") else None
        state.update(
            lm_head.tensors("lm_head.")
            if lm_head is not None
            else {"lm_head.weight": qtarget.lm_head.weight.detach().to(UNQUANTIZED_DTYPE)}
        )
    write_safetensors(state, out_dir / "model.safetensors")
    quant, quantization_config = hf_quant_configs(qtarget, prefix="model.")
    cfg = read_json(source_dir / "config.json", "target config")
    cfg["torch_dtype"] = str(UNQUANTIZED_DTYPE).removeprefix("torch.")
    if "dtype" in cfg:
        cfg["dtype"] = cfg["torch_dtype"]
    cfg["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "hf_quant_config.json").write_text(json.dumps(quant, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out_dir / name)
    return out_dir


def check_checkpoint(directory: str | Path) -> dict:
    """Verify a quantized checkpoint's layout against its hf_quant_config.json: every quantized
    weight with its scales in the deployment dtypes and shapes. → {"quant_algo", "quantized", "tensors"}."""
    from loopspec.weights import read_json, read_safetensors_dir

    directory = Path(directory)
    quant = read_json(directory / "hf_quant_config.json", "hf_quant_config.json")
    algo = (quant.get("quantization") or {}).get("quant_algo")
    if algo not in ("FP8", "NVFP4"):
        raise LoopspecError(f"{directory}: unsupported quant_algo {algo!r}")
    config = read_json(directory / "config.json", "config.json").get("quantization_config") or {}
    if config.get("quant_method") != "modelopt" or config.get("quant_algo") != algo:
        raise LoopspecError(f"{directory}: config.json's quantization_config does not name modelopt {algo}")
    state = read_safetensors_dir(directory)
    quantized = 0
    for name, scale in state.items():
        if not name.endswith(".weight_scale"):
            continue
        base = name.removesuffix("weight_scale")
        w, inp = state.get(base + "weight"), state.get(base + "input_scale")
        if w is None or not _fp32_scalar(inp):
            raise LoopspecError(f"{directory}: {base}weight needs weight, weight_scale and a scalar fp32 input_scale")
        if algo == "FP8":
            ok = w.dtype == torch.float8_e4m3fn and _fp32_scalar(scale)
        else:  # two e2m1 values per byte: [out, in/2]; one float8 scale per 16 inputs: [out, in/16]
            out, half = w.shape
            ok = (
                w.dtype == torch.uint8
                and scale.dtype == torch.float8_e4m3fn
                and tuple(scale.shape) == (out, 2 * half // NVFP4_BLOCK)
                and _fp32_scalar(state.get(base + "weight_scale_2"))
            )
        if not ok:
            raise LoopspecError(
                f"{directory}: {base}* is not a valid {algo} layout "
                f"(weight {w.dtype} {tuple(w.shape)}, weight_scale {scale.dtype} {tuple(scale.shape)})"
            )
        quantized += 1
    if not quantized:
        raise LoopspecError(f"{directory}: no quantized weights")
    return {"quant_algo": algo, "quantized": quantized, "tensors": len(state)}


def _fp32_scalar(t: torch.Tensor | None) -> bool:
    return t is not None and t.dim() == 0 and t.dtype == torch.float32
