"""modelopt FP8 / NVFP4 post-training quantization of the drafter (and, optionally, the target).

Calibration is real `modelopt.torch.quantization`: `mtq.quantize(model, cfg, forward_loop)` with
`FP8_DEFAULT_CFG` (per-tensor float8 e4m3 weights and activations) or `NVFP4_DEFAULT_CFG` (float4 e2m1
in blocks of 16 with float8 block scales and an fp32 global scale), max calibration. The forward loop
runs the drafter as decoding runs it: the target's real taps over calibration prompts and their greedy
continuations become the context, and draft stages run on `[anchor, MASK…]` blocks, a DLoop second
stage on the drafter's own pseudo-features included.

Deployment fuses projections that read the same input, and a fused GEMM has one input scale and one
weight scale: the drafter's q/k/v of every layer (the context K/V of all layers is one GEMM, the block
q/k/v of a layer another) share them, as modelopt's `preprocess_linear_fusion` sets them.

Checkpoints: modelopt's `export_hf_checkpoint` needs a transformers `PreTrainedModel` (it reads
`model.config` and calls `save_pretrained`), which the drafter is not. The z-lab checkpoint is written
here from modelopt's own export primitives (`get_quant_config`, `get_weight_scaling_factor[_2]`,
`get_activation_scaling_factor`, `to_quantized_weight`, `convert_hf_quant_config_format`), in the
layout TensorRT-LLM and vLLM read: FP8 `weight` float8_e4m3fn + `weight_scale` / `input_scale` fp32
scalars; NVFP4 `weight` uint8 [out, in/2] (two e2m1 per byte), `weight_scale` float8_e4m3fn
[out, in/16], `weight_scale_2` and `input_scale` fp32 scalars; `hf_quant_config.json` and
`quantization_config` in config.json.

modelopt is the optional `quant` extra and is imported lazily. NVFP4 calibration runs on a CPU (it only
records ranges); NVFP4 numerics need a Blackwell GPU (TensorRT) and are never run here.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from loopspec.errors import LoopspecError
from loopspec.model.drafter import Drafter
from loopspec.model.target import Target

PRECISIONS = ("fp8", "nvfp4")
NVFP4_GROUP = 16  # e2m1 values per float8 block scale
DEFAULT_CALIB_SIZE = 16
DEFAULT_CALIB_NEW_TOKENS = 64
UNQUANTIZED_DTYPE = torch.bfloat16  # norms, embeddings and excluded layers, as modelopt exports them

# Built-in calibration prompts: chat, code, math, writing, facts (the kinds of text a drafter meets).
DEFAULT_CALIB_PROMPTS = (
    "Explain how a hash table works and when it is a poor choice.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "Write a short poem about the sea at night.",
    "Summarize the causes of the French Revolution in five sentences.",
    "How do I reverse a linked list in C? Give the code.",
    "A train travels 120 km in 1.5 hours. What is its average speed in m/s?",
    "Give me three tips for writing a clear technical email.",
    "What is the difference between a process and a thread?",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Describe photosynthesis to a ten-year-old.",
    "Plan a three-day trip to Rome with a small budget.",
    "Solve for x: 3x + 7 = 22. Explain each step.",
    "Write a JavaScript function that debounces another function.",
    "What are the pros and cons of remote work?",
    "Translate into French: 'The library opens at nine and closes at six.'",
)

# Fused modules of loopspec's models → the Hugging Face modules they hold, in row order.
HF_SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def require_modelopt():
    """`modelopt.torch.quantization`, or a clear error naming the extra."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError:
        raise LoopspecError("quantization needs NVIDIA Model Optimizer: pip install 'loopspec[quant]'") from None
    return mtq


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise LoopspecError(f"unknown quantization precision {precision!r} (choose from {', '.join(PRECISIONS)})")


MODELOPT_CONFIG_NAMES = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}


def modelopt_config(precision: str) -> dict:
    check_precision(precision)
    mtq = require_modelopt()
    return copy.deepcopy(getattr(mtq, MODELOPT_CONFIG_NAMES[precision]))


# --------------------------------------------------------------------------------------------------
# calibration data


@dataclass
class CalibSequence:
    tokens: list[int]  # prompt + the target's greedy continuation
    prompt_len: int


def read_calib_prompts(path: str | Path | None) -> list[str]:
    """First turns of a `{"turns": [...]}` JSONL file, or the built-in prompts when `path` is None."""
    if path is None:
        return list(DEFAULT_CALIB_PROMPTS)
    path = Path(path)
    if not path.is_file():
        raise LoopspecError(f"calibration prompt file does not exist: {path}")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise LoopspecError(f"{path}:{number}: expected a JSON object with a 'turns' list") from None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise LoopspecError(f"{path}:{number}: 'turns' must be a non-empty list of strings")
            prompts.append(turns[0])
    if not prompts:
        raise LoopspecError(f"no prompts in {path}")
    return prompts


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt as the runtime encodes it for chat: the target's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


@torch.no_grad()
def calibration_sequences(target: Target, tokenizer, prompts: list[str], calib_size: int,
                          new_tokens: int = DEFAULT_CALIB_NEW_TOKENS) -> list[CalibSequence]:
    """The first `calib_size` prompts, each followed by the target's greedy continuation."""
    if calib_size < 1:
        raise LoopspecError(f"--calib-size must be >= 1, got {calib_size}")
    stop = set(target.cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    out = []
    for prompt in prompts[:calib_size]:
        ids = encode_prompt(tokenizer, prompt)
        limit = min(target.cfg.max_position_embeddings, len(ids) + new_tokens)
        if len(ids) >= limit:
            raise LoopspecError(f"calibration prompt of {len(ids)} tokens does not fit the target's context")
        cache = target.new_cache(limit)
        tokens = list(ids)
        logits = target(torch.tensor([ids]), cache, want_taps=False, last_logits_only=True).logits
        while len(tokens) < limit:
            nxt = int(logits[0, -1].argmax())
            tokens.append(nxt)
            if nxt in stop or len(tokens) == limit:
                break
            logits = target(torch.tensor([[nxt]]), cache, want_taps=False).logits
        out.append(CalibSequence(tokens, len(ids)))
    return out


# --------------------------------------------------------------------------------------------------
# calibration


def _layer_kv(drafter: Drafter, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's context K/V [N, 1, kvh, T, hd] through the layers' own k_proj/v_proj modules, so
    their quantizers see the context features (Drafter.context_kv fuses the weights and bypasses them)."""
    cos, sin = drafter.rotary(positions)  # [T, hd]
    pairs = [layer.self_attn.keys_values(features, cos, sin) for layer in drafter.layers]
    return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


@torch.no_grad()
def run_drafter_as_decoding(drafter: Drafter, target: Target, sequences: list[CalibSequence]) -> None:
    """Draft stages over each sequence as decoding meets them: context = the target's taps of the
    positions before the anchor; a stage every k-1 positions of the response; each followed by a DLoop
    stage on the drafter's own pseudo-features (design §4 step 3)."""
    cfg = drafter.cfg
    k, mask = cfg.block_size, cfg.mask_token_id
    head = target.lm_head.weight if drafter.draft_ids is None else target.lm_head.weight[drafter.draft_ids]
    for seq in sequences:
        T = len(seq.tokens)
        taps = target(torch.tensor([seq.tokens]), target.new_cache(T), want_taps=True).taps  # [1, T, n·H]
        ctx_k, ctx_v = _layer_kv(drafter, drafter.features(taps), torch.arange(T))  # [N, 1, kvh, T, hd]
        for a in range(seq.prompt_len, T, k - 1):  # the first anchor: the token after the prompt
            block = torch.full((1, k), mask, dtype=torch.long)
            block[0, 0] = seq.tokens[a]
            hidden = drafter(target.embed_tokens(block), torch.arange(a, a + k),
                             ctx_k[:, :, :, :a], ctx_v[:, :, :, :a])  # [1, k, H]
            # stage 2: pseudo-features z(p+1) at p = a .. a+k-2, anchor = stage 1's last draft at a+k-1
            pseudo_k, pseudo_v = _layer_kv(drafter, hidden[:, 1:], torch.arange(a, a + k - 1))
            best = int((hidden[0, -1] @ head.T).argmax())
            block[0, 0] = best if drafter.draft_ids is None else int(drafter.draft_ids[best])
            drafter(target.embed_tokens(block), torch.arange(a + k - 1, a + 2 * k - 1),
                    torch.cat([ctx_k[:, :, :, :a], pseudo_k], dim=3), torch.cat([ctx_v[:, :, :, :a], pseudo_v], dim=3))


def fuse_shared_inputs(drafter: nn.Module) -> None:
    """One input scale and one weight scale for every drafter q/k/v projection (see the module doc)."""
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    group = [getattr(layer.self_attn, name) for layer in drafter.layers for name in ("q_proj", "k_proj", "v_proj")]
    preprocess_linear_fusion(group)


def quantize_drafter(drafter: Drafter, target: Target, calib_prompts: list[CalibSequence], precision: str,
                     calib_size: int | None = None) -> Drafter:
    """A modelopt-calibrated copy of `drafter` (QuantLinear modules with their quantizers' ranges);
    `drafter` itself stays as it is (the fp32 reference)."""
    cfg = modelopt_config(precision)
    mtq = require_modelopt()
    sequences = calib_prompts[:calib_size] if calib_size else calib_prompts
    if not sequences:
        raise LoopspecError("quantization needs at least one calibration prompt")
    if drafter.cfg.mask_token_id is None:
        raise LoopspecError("the drafter has no mask_token_id; calibration runs it as decoding does")
    target.set_taps(drafter.cfg.target_layer_ids)
    model = copy.deepcopy(drafter).eval()
    model = mtq.quantize(model, cfg, lambda m: run_drafter_as_decoding(m, target, sequences))
    fuse_shared_inputs(model)
    return model


def quantize_target(target: Target, calib_prompts: list[CalibSequence], precision: str,
                    calib_size: int | None = None) -> Target:
    """A modelopt-calibrated copy of the target (its lm_head stays unquantized, as modelopt's configs say)."""
    cfg = modelopt_config(precision)
    mtq = require_modelopt()
    sequences = calib_prompts[:calib_size] if calib_size else calib_prompts

    def forward_loop(model):
        for seq in sequences:
            model(torch.tensor([seq.tokens]), model.new_cache(len(seq.tokens)), want_taps=False)

    return mtq.quantize(copy.deepcopy(target).eval(), cfg, forward_loop)


# --------------------------------------------------------------------------------------------------
# checkpoint tensors from modelopt's export primitives


@dataclass
class QuantizedWeight:
    """One calibrated Linear in deployment form (modelopt's export math)."""
    precision: str  # "fp8" | "nvfp4"
    weight: torch.Tensor  # fp8: float8_e4m3fn [out, in]; nvfp4: uint8 [out, in/2] (two e2m1 per byte, low nibble first)
    weight_scale: torch.Tensor  # fp8: fp32 scalar; nvfp4: float8_e4m3fn [out, in/16]
    weight_scale_2: torch.Tensor | None  # nvfp4: fp32 scalar (global)
    input_scale: torch.Tensor  # fp32 scalar
    bias: torch.Tensor | None
    block_size: int  # 0 (per tensor) or 16

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """The slice of output rows [start, stop) (scalars shared): a fused module's parts."""
        per_row = self.weight_scale.dim() > 0
        return QuantizedWeight(self.precision, self.weight[start:stop],
                               self.weight_scale[start:stop] if per_row else self.weight_scale,
                               self.weight_scale_2, self.input_scale,
                               None if self.bias is None else self.bias[start:stop], self.block_size)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensors under `prefix` (copies: the parts of a fused module share scalars)."""
        out = {"weight": self.weight, "weight_scale": self.weight_scale, "input_scale": self.input_scale}
        if self.weight_scale_2 is not None:
            out["weight_scale_2"] = self.weight_scale_2
        if self.bias is not None:
            out["bias"] = self.bias.to(UNQUANTIZED_DTYPE)
        return {prefix + k: v.clone() for k, v in out.items()}


def quantized_weight(module: nn.Module) -> QuantizedWeight | None:
    """Deployment tensors of one calibrated Linear, None when its quantizers are disabled."""
    from modelopt.torch.export import quant_utils as qu

    fmt = qu.get_quantization_format(module)
    if fmt is None:
        return None
    if fmt not in PRECISIONS:
        raise LoopspecError(f"unexpected modelopt quantization format {fmt!r}")
    weight = module.weight.detach().float()
    scale = qu.get_weight_scaling_factor(module)
    scale_2 = qu.get_weight_scaling_factor_2(module)
    block = qu.get_weight_block_size(module)
    packed = qu.to_quantized_weight(weight, scale, fmt, scale_2, block)
    input_scale = qu.get_activation_scaling_factor(module)
    if input_scale is None:
        raise LoopspecError("a quantized linear without a calibrated input range (was calibration run?)")
    if fmt == "fp8":
        scale = scale.float().reshape(())
    return QuantizedWeight(fmt, packed, scale, None if scale_2 is None else scale_2.float().reshape(()),
                           input_scale.float().reshape(()), None if module.bias is None else module.bias.detach(),
                           block)


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """{module name: QuantizedWeight} for every quantized Linear of a calibrated model."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and hasattr(module, "weight_quantizer"):
            q = quantized_weight(module)
            if q is not None:
                out[name] = q
    return out


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
            state.update(q.tensors(prefix + name + ".") if q is not None
                         else {prefix + name + "." + k: v for k, v in plain.items()})
            continue
        start, base = 0, prefix + name.removesuffix(leaf)
        for part, size in zip(parts, _split_sizes(model, name, module)):
            state.update(q.rows(start, start + size).tensors(base + part + ".") if q is not None
                         else {base + part + "." + k: v[start:start + size] for k, v in plain.items()})
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
    if qdrafter.draft_ids is not None:  # EAGLE-3 / vLLM convention: target id = draft id + d2t
        d2t = qdrafter.draft_ids - torch.arange(qdrafter.draft_ids.numel())
        write_safetensors({"d2t": d2t.to(torch.int64)}, out_dir / "d2t.safetensors")
    return out_dir


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


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
        state.update(lm_head.tensors("lm_head.") if lm_head is not None
                     else {"lm_head.weight": qtarget.lm_head.weight.detach().to(UNQUANTIZED_DTYPE)})
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


def quantize_target_checkpoint(src: str | Path, dst: str | Path, precision: str,
                               calib_prompts: str | Path | None = None,
                               calib_size: int = DEFAULT_CALIB_SIZE) -> Path:
    """An HF target checkpoint → its modelopt-quantized HF checkpoint (calibrated on `calib_prompts`
    or the built-in prompts)."""
    from loopspec.weights import load_target_dir, load_tokenizer

    check_precision(precision)
    target = load_target_dir(src)
    sequences = calibration_sequences(target, load_tokenizer(src), read_calib_prompts(calib_prompts), calib_size)
    return export_target_checkpoint(quantize_target(target, sequences, precision), src, dst)


# --------------------------------------------------------------------------------------------------
# ONNX engines with quantized drafter (and target) graphs


def export_quantized_engines(target: Target, drafter: Drafter, out_dir: str | Path, *, precision: str,
                             drafter_weights: dict[str, QuantizedWeight],
                             target_weights: dict[str, QuantizedWeight] | None = None,
                             target_dir: str | Path, drafter_dir: str | Path | None = None,
                             max_context: int | None = None, block_size: int | None = None,
                             calibration: dict | None = None):
    """The four engines in one artifact directory, as `convert onnx` lays it out, with the drafter's
    graphs (and the target's, given `target_weights`) quantized: FP8 as standard Q/DQ that ONNX
    Runtime runs, NVFP4 as modelopt's pattern for TensorRT. Unquantized graphs are the fp32 export.
    The manifest records stage "quantized", the precision and which engines are quantized."""
    from loopspec.convert.qdq import FP8_OPSET, NVFP4_OPSET, export_quantized_graph, qdq_copy
    from loopspec.engines.export import (OPSET, DrafterBlock, DrafterContext, TargetVerify, copy_run_files,
                                         drafter_source, example_inputs, export_graph)
    from loopspec.engines.manifest import Manifest, source_hashes, tool_versions, write_manifest
    from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, TARGET_VERIFY, engine_specs

    check_precision(precision)
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "manifest.json").is_file())):
        raise LoopspecError(f"{out_dir} exists and is not an artifact directory; refusing to overwrite it")
    limits = [target.cfg.max_position_embeddings, drafter.cfg.max_position_embeddings]
    max_context = min([max_context or min(limits)] + limits)
    specs = engine_specs(target.cfg, drafter.cfg, max_context=max_context, block_size=block_size)
    qdrafter = qdq_copy(drafter, drafter_weights)
    modules = {TARGET_VERIFY: TargetVerify(qdq_copy(target, target_weights) if target_weights else target,
                                           drafter.cfg.target_layer_ids),
               DRAFTER_CONTEXT: DrafterContext(qdrafter, from_taps=True),
               DRAFTER_CONTEXT_HIDDEN: DrafterContext(qdrafter, from_taps=False),
               DRAFTER_BLOCK: DrafterBlock(qdrafter, target.embed_tokens.weight, target.lm_head.weight)}
    quantized = [DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK] + ([TARGET_VERIFY] if target_weights else [])

    work = out_dir.with_name(out_dir.name + ".partial")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    files = {}
    try:
        for name, module in modules.items():
            files[name] = f"{name}.onnx"
            args = example_inputs(specs[name], target.cfg.vocab_size)
            if name in quantized:
                export_quantized_graph(module, specs[name], args, work / files[name], precision)
            else:
                export_graph(module, specs[name], args, work / files[name], OPSET)
        copy_run_files(target_dir, drafter, work)
        opsets = {name: (FP8_OPSET if precision == "fp8" else NVFP4_OPSET) if name in quantized else OPSET
                  for name in modules}
        settings = {"opset": opsets, "max_context": max_context, "block_size": specs[DRAFTER_BLOCK].ranges["block"][1],
                    "target_layer_ids": drafter.cfg.target_layer_ids, "quantized_engines": quantized,
                    "exporter": {"quantized": "torch.onnx.export (dynamo, custom Q/DQ translations)",
                                 "fp32": "torch.onnx.export (TorchScript)"},
                    "quantization": {"tool": "nvidia-modelopt", "config": MODELOPT_CONFIG_NAMES[precision],
                                     "algorithm": "max", **(calibration or {})}}
        sources = {"target": source_hashes(target_dir), "drafter": drafter_source(drafter, drafter_dir)}
        write_manifest(work, stage="quantized", precision=precision, specs=specs, engine_files=files, sources=sources,
                       settings=settings, tools=tool_versions(("torch", "onnx", "onnxruntime", "onnxscript",
                                                               "nvidia-modelopt", "loopspec")))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    work.rename(out_dir)
    return Manifest(out_dir, json.loads((out_dir / "manifest.json").read_text()))


# --------------------------------------------------------------------------------------------------
# checks of what was written


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
            ok = (w.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
                  and tuple(scale.shape) == (out, 2 * half // NVFP4_GROUP)
                  and _fp32_scalar(state.get(base + "weight_scale_2")))
        if not ok:
            raise LoopspecError(f"{directory}: {base}* is not a valid {algo} layout "
                                f"(weight {w.dtype} {tuple(w.shape)}, weight_scale {scale.dtype} {tuple(scale.shape)})")
        quantized += 1
    if not quantized:
        raise LoopspecError(f"{directory}: no quantized weights")
    return {"quant_algo": algo, "quantized": quantized, "tensors": len(state)}


def _fp32_scalar(t: torch.Tensor | None) -> bool:
    return t is not None and t.dim() == 0 and t.dtype == torch.float32


def check_onnx(onnx_dir: str | Path) -> dict:
    """Verify the quantized engines' graphs: FP8 → QuantizeLinear/DequantizeLinear pairs with float8e4m3fn
    zero points and float8 weights; NVFP4 → float4e2m1 weights behind two DequantizeLinear (float8 block
    scales of 1/16 of the row, blocked axis -1, block 16) and TRT_FP4DynamicQuantize on activations.
    → {engine: {"quantized_weights": n, "activation_quantizers": m}}."""
    import onnx
    from onnx import TensorProto

    from loopspec.engines.manifest import read_manifest

    manifest = read_manifest(onnx_dir)
    precision = manifest.precision
    check_precision(precision)
    out = {}
    for engine in manifest.data["settings"].get("quantized_engines", []):
        model = onnx.load(str(manifest.path(engine)))  # external data loaded from beside the graph
        inits = {i.name: i for i in model.graph.initializer}
        nodes = list(model.graph.node)
        producers = {o: n for n in nodes for o in n.output}
        if precision == "fp8":
            weights = [i for i in inits.values() if i.data_type == TensorProto.FLOAT8E4M3FN and len(i.dims) == 2]
            quantize = [n for n in nodes if n.op_type == "QuantizeLinear"]
            bad = [n.name for n in quantize if len(n.input) < 3 or _elem_type(n.input[2], inits, producers)
                   != TensorProto.FLOAT8E4M3FN]
            if bad or not quantize:
                raise LoopspecError(f"{engine}: activation QuantizeLinear without a float8e4m3fn zero point: {bad}")
            weight_dq = [n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in {w.name for w in weights}]
        else:
            weights = [i for i in inits.values() if i.data_type == TensorProto.FLOAT4E2M1]
            quantize = [n for n in nodes if n.op_type == "TRT_FP4DynamicQuantize"]
            weight_dq = [n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in {w.name for w in weights}]
            for n in weight_dq:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                scale = producers.get(n.input[1])
                block = inits.get(scale.input[0]) if scale is not None and scale.op_type == "DequantizeLinear" else None
                w = inits[n.input[0]]
                if (attrs.get("block_size") != NVFP4_GROUP or attrs.get("axis") != -1 or block is None
                        or block.data_type != TensorProto.FLOAT8E4M3FN
                        or list(block.dims) != [w.dims[0], w.dims[1] // NVFP4_GROUP]):
                    raise LoopspecError(f"{engine}: float4 weight {w.name} is not dequantized by float8 block scales "
                                        f"[out, in/16] with block_size 16")
        if not weights or len(weight_dq) != len(weights) or not quantize:
            raise LoopspecError(f"{engine}: expected quantized weights behind DequantizeLinear and quantized "
                                f"activations (found {len(weights)} weights, {len(weight_dq)} weight DQ, "
                                f"{len(quantize)} activation quantizers)")
        out[engine] = {"quantized_weights": len(weights), "activation_quantizers": len(quantize)}
    return out


def _elem_type(name: str, inits: dict, producers: dict) -> int | None:
    """Element type of a constant input: an initializer or a Constant node's value."""
    if name in inits:
        return inits[name].data_type
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        return node.attribute[0].t.data_type
    return None


# --------------------------------------------------------------------------------------------------
# accuracy of the FP8 drafter (ONNX Runtime) against the fp32 drafter (PyTorch)


@torch.no_grad()
def drafter_logit_error(onnx_dir: str | Path, target: Target, drafter: Drafter, sequences: list[CalibSequence],
                        num_threads: int | None = None) -> dict:
    """The exported drafter end to end (its context engine on the target's taps, then draft blocks
    every k-1 positions of each response) against the fp32 PyTorch drafter on the same inputs: the
    draft logits' absolute error (max, mean, and the logits' scale) and how often the top-1 draft agrees."""
    import numpy as np

    from loopspec.engines.manifest import read_manifest
    from loopspec.engines.ort import EngineSession, check_precision as check_runnable
    from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT

    manifest = read_manifest(onnx_dir)
    check_runnable(manifest.precision, str(onnx_dir))
    sessions = {n: EngineSession(manifest.path(n), manifest.spec(n), num_threads) for n in (DRAFTER_CONTEXT, DRAFTER_BLOCK)}
    target.set_taps(drafter.cfg.target_layer_ids)
    head = target.lm_head.weight if drafter.draft_ids is None else target.lm_head.weight[drafter.draft_ids]
    k, mask = drafter.cfg.block_size, drafter.cfg.mask_token_id
    max_err = abs_sum = scale = 0.0
    agree = positions = blocks = 0
    for seq in sequences:
        T = len(seq.tokens)
        taps = target(torch.tensor([seq.tokens]), target.new_cache(T), want_taps=True).taps  # [1, T, n·H]
        ref_k, ref_v = drafter.context_kv(drafter.features(taps), torch.arange(T))
        run = sessions[DRAFTER_CONTEXT].run(taps=taps.numpy(), positions=np.arange(T, dtype=np.int64)[None])
        q_k, q_v = run["context_key"], run["context_value"]
        for a in range(seq.prompt_len, T, k - 1):
            block = torch.full((1, k), mask, dtype=torch.long)
            block[0, 0] = seq.tokens[a]
            ref_hidden = drafter(target.embed_tokens(block), torch.arange(a, a + k), ref_k[:, :, :, :a], ref_v[:, :, :, :a])
            out = sessions[DRAFTER_BLOCK].run(block_ids=block.numpy(), positions=np.arange(a, a + k, dtype=np.int64)[None],
                                              context_key=np.ascontiguousarray(q_k[:, :, :, :a]),
                                              context_value=np.ascontiguousarray(q_v[:, :, :, :a]))
            ref_logits = ref_hidden[0, 1:] @ head.T  # [k-1, V or Vd]
            q_logits = torch.from_numpy(out["hidden"][0, 1:]) @ head.T
            diff = (q_logits - ref_logits).abs()
            max_err, abs_sum = max(max_err, float(diff.max())), abs_sum + float(diff.mean()) * (k - 1)
            scale = max(scale, float(ref_logits.abs().max()))
            agree += int((q_logits.argmax(-1) == ref_logits.argmax(-1)).sum())
            positions, blocks = positions + k - 1, blocks + 1
    if not blocks:
        raise LoopspecError("no draft block to measure (the evaluation prompts have no response tokens)")
    return {"max_abs": round(max_err, 4), "mean_abs": round(abs_sum / positions, 5), "logit_scale": round(scale, 3),
            "top1_agreement": round(agree / positions, 4), "blocks": blocks, "positions": positions}


# --------------------------------------------------------------------------------------------------
# `loopspec convert quantize`

REPORT = "quantize.json"


def load_pair(target: str, drafter: str, mask_token_id: int | None = None):
    """(target dir, Target, tokenizer, drafter dir, Drafter) as plain fp32 modules (no inference
    packing: modelopt quantizes nn.Linear modules). The drafter must be a trained one in a directory."""
    from loopspec.defaults import DEFAULT_DRAFTER_DIR
    from loopspec.model.drafter import check_fits, resolve_mask_token_id
    from loopspec.weights import load_target_dir, load_tokenizer, resolve_target_dir

    target_dir = resolve_target_dir(target)
    if drafter in (None, "none"):
        raise LoopspecError("quantize needs a drafter (got --drafter none)")
    if drafter == "default":
        if str(target) != "default" or not DEFAULT_DRAFTER_DIR.is_dir():
            raise LoopspecError("quantize needs a trained drafter: pass --drafter DIR (the shipped one fits only "
                                "--target default)")
        drafter = DEFAULT_DRAFTER_DIR
    model, tokenizer = load_target_dir(target_dir), load_tokenizer(target_dir)
    draft = Drafter.load(drafter)
    if draft.cfg.mask_token_id is None:
        draft.cfg.mask_token_id = resolve_mask_token_id(mask_token_id, len(tokenizer), model.cfg.vocab_size)
    check_fits(draft.cfg, model.cfg)
    return target_dir, model, tokenizer, Path(drafter), draft


def quantize_pair(*, target: str, drafter: str, out_dir: str | Path, precision: str,
                  calib_prompts: str | Path | None = None, calib_size: int = DEFAULT_CALIB_SIZE,
                  target_too: bool = False, max_context: int | None = None, mask_token_id: int | None = None,
                  validate: bool = True, num_threads: int | None = None) -> dict:
    """Calibrate, export and check; → the report (also written to `out_dir`/quantize.json).

    out_dir/drafter   z-lab checkpoint, modelopt-quantized (config.json, model.safetensors, hf_quant_config.json)
    out_dir/target    HF checkpoint of the quantized target (with target_too)
    out_dir/onnx      the four engines (quantized drafter graphs), manifest precision = `precision`
    FP8: ONNX Runtime runs the engines; the drafter's logit error, the offline τ and greedy identity are
    measured against the fp32 reference. NVFP4: structure checks only (numerics need a Blackwell GPU)."""
    import time

    check_precision(precision)
    require_modelopt()
    if calib_size < 1:
        raise LoopspecError(f"--calib-size must be >= 1, got {calib_size}")
    prompts = read_calib_prompts(calib_prompts)  # a missing or malformed file fails before any work
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / REPORT).is_file())):
        raise LoopspecError(f"{out_dir} exists and is not a quantize output directory; refusing to overwrite it")
    if num_threads:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    target_dir, target_model, tokenizer, drafter_dir, drafter_model = load_pair(target, drafter, mask_token_id)
    sequences = calibration_sequences(target_model, tokenizer, prompts, calib_size)
    calibration = {"prompts": str(calib_prompts) if calib_prompts else "built-in", "calib_size": len(sequences),
                   "tokens": sum(len(s.tokens) for s in sequences), "new_tokens_per_prompt": DEFAULT_CALIB_NEW_TOKENS}
    qdrafter = quantize_drafter(drafter_model, target_model, sequences, precision)
    for sub in ("drafter", "target", "onnx"):
        shutil.rmtree(out_dir / sub, ignore_errors=True)
    export_drafter_checkpoint(qdrafter, out_dir / "drafter")
    report = {"precision": precision, "calibration": calibration,
              "checkpoints": {"drafter": check_checkpoint(out_dir / "drafter")}}
    target_weights = None
    if target_too:
        qtarget = quantize_target(target_model, sequences, precision)
        export_target_checkpoint(qtarget, target_dir, out_dir / "target")
        report["checkpoints"]["target"] = check_checkpoint(out_dir / "target")
        target_weights = quantized_weights(qtarget)
    export_quantized_engines(target_model, drafter_model, out_dir / "onnx", precision=precision,
                             drafter_weights=quantized_weights(qdrafter), target_weights=target_weights,
                             target_dir=target_dir, drafter_dir=drafter_dir, max_context=max_context,
                             calibration=calibration)
    report["onnx"] = check_onnx(out_dir / "onnx")
    if precision == "nvfp4":
        from loopspec.engines.ort import NVFP4_NOT_HERE

        report["numerics"] = NVFP4_NOT_HERE
    elif validate:
        from loopspec.convert.validate import PROMPT_TEXTS, validate_onnx

        report["validation"] = validate_onnx(out_dir / "onnx", target_model, drafter_model, precision,
                                             num_threads=num_threads)
        held_out = calibration_sequences(target_model, tokenizer, list(PROMPT_TEXTS), len(PROMPT_TEXTS))
        report["drafter_logits"] = drafter_logit_error(out_dir / "onnx", target_model, drafter_model, held_out,
                                                       num_threads)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_quantize_report(report: dict, out_dir: str | Path) -> str:
    out_dir = Path(out_dir)
    c = report["calibration"]
    lines = [f"modelopt {report['precision'].upper()} calibration on {c['calib_size']} prompts ({c['tokens']} tokens, "
             f"{c['prompts']}) in {report['seconds']} s"]
    for name, info in report["checkpoints"].items():
        lines.append(f"  {out_dir / name}: {info['quant_algo']} checkpoint, {info['quantized']} quantized linears")
    engines = ", ".join(f"{e} ({v['quantized_weights']} weights)" for e, v in report["onnx"].items())
    lines.append(f"  {out_dir / 'onnx'}: quantized engines {engines}")
    if "numerics" in report:
        lines.append(f"  {report['numerics']}")
    if "drafter_logits" in report:
        d = report["drafter_logits"]
        lines.append(f"  drafter logits vs fp32 over {d['positions']} draft positions: max |err| {d['max_abs']:.3g}, "
                     f"mean |err| {d['mean_abs']:.3g} (logit scale {d['logit_scale']:.3g}), "
                     f"top-1 agreement {d['top1_agreement']:.1%}")
    if "validation" in report:
        from loopspec.convert.validate import format_report

        lines.append(format_report(report["validation"]))
    return "\n".join(lines)
