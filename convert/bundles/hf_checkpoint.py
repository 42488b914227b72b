"""The Hugging Face part of a bundle, shared by the frameworks that serve the checkpoint: drafter/
(a block drafter over the full vocabulary, an EAGLE-3 drafter as it is) and target/ (the target's
checkpoint, cast or modelopt-quantized)."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from loopspec.convert.bundles.common import DTYPES, BundleParts, serves_its_draft_vocab
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.weights import read_json, read_safetensors, write_safetensors

# what a framework needs beside the weights to serve the target (chat template, stop tokens, tokenizer)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def full_vocab_drafter(drafter: Drafter) -> Drafter:
    """The drafter drafting over the full vocabulary, sharing its weights: no d2t map, and no
    draft-vocabulary size in its config (what drafter/ holds)."""
    full = copy.copy(drafter)
    full.cfg = replace(drafter.cfg, extra={k: v for k, v in drafter.cfg.extra.items() if k != "draft_vocab_size"})
    full.draft_ids = None
    return full


def write_hf_checkpoint(parts: BundleParts, tmp: Path) -> None:
    """drafter/ (z-lab or DeepSpec layout, full vocabulary; an EAGLE-3 drafter in SpecForge's layout with
    its own draft vocabulary) and target/ (HF, maybe quantized)."""
    dtype = DTYPES[parts.dtype]
    drafter = parts.drafter if serves_its_draft_vocab(parts.drafter.cfg.kind) else full_vocab_drafter(parts.drafter)
    drafter.save(tmp / "drafter", dtype=dtype)
    if parts.precision is None:
        export_target(parts.target_dir, tmp / "target", dtype)
    else:
        quantize_target(parts.target_dir, tmp / "target", parts.precision, parts.calib_prompts, parts.calib_size)


def export_target(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """Copy an HF checkpoint shard by shard, floats cast to `dtype` (one shard in memory at a time)."""
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise LoopspecError(f"no *.safetensors file in {src}")
    dst.mkdir(parents=True)
    for shard in shards:
        state = read_safetensors(shard)
        write_safetensors(
            {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in state.items()}, dst / shard.name
        )
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shutil.copyfile(index, dst / index.name)
    cfg = with_rope_theta(read_json(src / "config.json", "target config"))
    name = str(dtype).removeprefix("torch.")
    cfg["torch_dtype"] = name
    if "dtype" in cfg:
        cfg["dtype"] = name
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not any(f.startswith("tokenizer") for f in copied):
        raise LoopspecError(f"the target {src} has no tokenizer files; the engines need them")
    for f in copied:
        shutil.copyfile(src / f, dst / f)


def with_rope_theta(cfg: dict) -> dict:
    """A transformers-5 config with the keys readers built on transformers 4 take instead, beside the
    new ones: `rope_theta` (θ is only inside `rope_parameters`; they would fall back to 10000),
    `rope_scaling` for a scaled RoPE (llama3, YaRN: they would run plain RoPE), and Qwen3-MoE's
    `num_experts` (saved as `num_local_experts`: they would build a dense model)."""
    rope = cfg.get("rope_parameters") or {}
    extra = {}
    if cfg.get("rope_theta") is None and rope.get("rope_theta") is not None:
        extra["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and cfg.get("rope_scaling") is None:
        extra["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if cfg.get("model_type") == "qwen3_moe" and cfg.get("num_experts") is None and "num_local_experts" in cfg:
        extra["num_experts"] = cfg["num_local_experts"]
    return {**cfg, **extra}


def add_rope_theta(config_path: Path) -> None:
    config_path.write_text(json.dumps(with_rope_theta(read_json(config_path, "target config")), indent=2) + "\n")


def quantize_target(
    src: Path, dst: Path, precision: str, calib_prompts: str | None = None, calib_size: int | None = None
) -> None:
    """A modelopt-quantized HF checkpoint of the target (convert/quantize.py does the calibration)."""
    from loopspec.convert.quantize import quantize_target_checkpoint

    options = {"calib_prompts": calib_prompts} | ({"calib_size": calib_size} if calib_size else {})
    quantize_target_checkpoint(src, dst, precision, **options)
    add_rope_theta(dst / "config.json")
