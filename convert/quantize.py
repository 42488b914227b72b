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

What is written from the calibrated modules: `QuantizedWeight` per Linear, computed by modelopt's
export primitives (`get_weight_scaling_factor[_2]`, `get_activation_scaling_factor`,
`to_quantized_weight`); convert/quant_checkpoint.py lays them out as z-lab / Hugging Face checkpoints
(modelopt's `export_hf_checkpoint` needs a transformers PreTrainedModel, which these modules are not)
and convert/qdq.py as ONNX graphs. `loopspec convert quantize` (quantize_pair) does all of it and, for
FP8, measures the ONNX Runtime engines against the fp32 drafter: artifacts that fail that validation
never replace the output directory (they are kept aside, and the command exits 2).

modelopt is the optional `quant` extra and is imported lazily. NVFP4 calibration runs on a CPU (it only
records ranges); NVFP4 plans need a Blackwell GPU (TensorRT), so on a CPU the NVFP4 drafter's accuracy
(logit error, offline τ) is measured through convert/qdq.py's PyTorch emulation of NVFP4 arithmetic.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.convert.qdq import check_precision
from loopspec.convert.quant_checkpoint import check_checkpoint, export_drafter_checkpoint, export_target_checkpoint
from loopspec.convert.quant_weights import QuantizedWeight, quantized_weights
from loopspec.engines.staging import check_out_dir, replace_dir, staged_dir
from loopspec.errors import LoopspecError
from loopspec.pair import load_pair
from loopspec.prompts import prompt_ids, read_prompts
from loopspec.model.dflash import Drafter
from loopspec.model.drafter_kinds import require_zlab_block
from loopspec.model.target import Target

DEFAULT_CALIB_SIZE = 16
DEFAULT_CALIB_NEW_TOKENS = 64

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


def require_modelopt():
    """`modelopt.torch.quantization`, or a clear error naming the extra."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError:
        raise LoopspecError("quantization needs NVIDIA Model Optimizer: pip install 'loopspec[quant]'") from None
    return mtq


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
    return read_prompts(path, what="calibration prompt file")


@torch.no_grad()
def calibration_sequences(
    target: Target, tokenizer, prompts: list[str], calib_size: int, new_tokens: int = DEFAULT_CALIB_NEW_TOKENS
) -> list[CalibSequence]:
    """The first `calib_size` prompts, each followed by the target's greedy continuation."""
    if calib_size < 1:
        raise LoopspecError(f"--calib-size must be >= 1, got {calib_size}")
    stop = set(target.cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    out = []
    for prompt in prompts[:calib_size]:
        ids = prompt_ids(tokenizer, prompt)
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
    stage on the drafter's own pseudo-features (DLoop, docs/concepts.md)."""
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
            hidden = drafter(
                target.embed_tokens(block), torch.arange(a, a + k), ctx_k[:, :, :, :a], ctx_v[:, :, :, :a]
            )  # [1, k, H]
            # stage 2: pseudo-features z(p+1) at p = a .. a+k-2, anchor = stage 1's last draft at a+k-1
            pseudo_k, pseudo_v = _layer_kv(drafter, hidden[:, 1:], torch.arange(a, a + k - 1))
            best = int((hidden[0, -1] @ head.T).argmax())
            block[0, 0] = best if drafter.draft_ids is None else int(drafter.draft_ids[best])
            drafter(
                target.embed_tokens(block),
                torch.arange(a + k - 1, a + 2 * k - 1),
                torch.cat([ctx_k[:, :, :, :a], pseudo_k], dim=3),
                torch.cat([ctx_v[:, :, :, :a], pseudo_v], dim=3),
            )


def fuse_shared_inputs(drafter: nn.Module) -> None:
    """One input scale and one weight scale for every drafter q/k/v projection (see the module doc)."""
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    group = [getattr(layer.self_attn, name) for layer in drafter.layers for name in ("q_proj", "k_proj", "v_proj")]
    preprocess_linear_fusion(group)


def quantize_drafter(
    drafter: Drafter, target: Target, calib_prompts: list[CalibSequence], precision: str, calib_size: int | None = None
) -> Drafter:
    """A modelopt-calibrated copy of `drafter` (QuantLinear modules with their quantizers' ranges);
    `drafter` itself stays as it is (the fp32 reference)."""
    require_zlab_block(drafter.cfg, "quantization")  # its calibration and export run z-lab's block
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


def quantize_target(
    target: Target, calib_prompts: list[CalibSequence], precision: str, calib_size: int | None = None
) -> Target:
    """A modelopt-calibrated copy of the target (its lm_head stays unquantized, as modelopt's configs say)."""
    cfg = modelopt_config(precision)
    mtq = require_modelopt()
    sequences = calib_prompts[:calib_size] if calib_size else calib_prompts

    def forward_loop(model):
        for seq in sequences:
            model(torch.tensor([seq.tokens]), model.new_cache(len(seq.tokens)), want_taps=False)

    return mtq.quantize(copy.deepcopy(target).eval(), cfg, forward_loop)


def quantize_target_checkpoint(
    src: str | Path,
    dst: str | Path,
    precision: str,
    calib_prompts: str | Path | None = None,
    calib_size: int = DEFAULT_CALIB_SIZE,
) -> Path:
    """An HF target checkpoint → its modelopt-quantized HF checkpoint (calibrated on `calib_prompts`
    or the built-in prompts)."""
    from loopspec.weights import load_target_dir, load_tokenizer

    check_precision(precision)
    target = load_target_dir(src)
    sequences = calibration_sequences(target, load_tokenizer(src), read_calib_prompts(calib_prompts), calib_size)
    return export_target_checkpoint(quantize_target(target, sequences, precision), src, dst)


# --------------------------------------------------------------------------------------------------
# accuracy of a quantized drafter against the fp32 drafter


def compare_drafters(
    target: Target, drafter: Drafter, sequences: list[CalibSequence], quantized_drafter, with_tau: bool = False
) -> dict:
    """The quantized drafter end to end (its context K/V from the target's taps, then draft blocks every
    k-1 positions of each response) against the fp32 PyTorch drafter on the same inputs: the draft
    logits' absolute error (max, mean, and the logits' scale) and how often the top-1 draft agrees.
    With `with_tau`, also the offline τ of both (a block at every anchor of the responses, accepted
    while the chain matches the target's greedy tokens) and its relative drop.

    quantized_drafter(taps [1, T, n·H] of a sequence) → hidden(block [1, k], anchor a) → hidden [1, k, H]: the
    quantized drafter's block at anchor a on the context of that sequence's positions before a."""
    from loopspec.convert.validate import offline_tau
    from loopspec.model.draft_head import draft_candidates

    target.set_taps(drafter.cfg.target_layer_ids)
    head = target.lm_head.weight if drafter.draft_ids is None else target.lm_head.weight[drafter.draft_ids]
    k, mask = drafter.cfg.block_size, drafter.cfg.mask_token_id
    max_err = abs_sum = scale = 0.0
    agree = positions = blocks = 0
    taus_ref, taus_quantized = [], []
    for seq in sequences:
        T = len(seq.tokens)
        taps = target(torch.tensor([seq.tokens]), target.new_cache(T), want_taps=True).taps  # [1, T, n·H]
        ref_k, ref_v = drafter.context_kv(drafter.features(taps), torch.arange(T))
        quantized_hidden = quantized_drafter(taps)

        def logits(a: int, quantized: bool) -> torch.Tensor:  # [k-1, V or Vd]: the block at anchor a
            block = torch.full((1, k), mask, dtype=torch.long)
            block[0, 0] = seq.tokens[a]
            if quantized:
                hidden = quantized_hidden(block, a)
            else:
                hidden = drafter(
                    target.embed_tokens(block), torch.arange(a, a + k), ref_k[:, :, :, :a], ref_v[:, :, :, :a]
                )
            return hidden[0, 1:].float() @ head.T

        for a in range(seq.prompt_len, T, k - 1):
            ref_logits, q_logits = logits(a, False), logits(a, True)
            diff = (q_logits - ref_logits).abs()
            max_err, abs_sum = max(max_err, float(diff.max())), abs_sum + float(diff.mean()) * (k - 1)
            scale = max(scale, float(ref_logits.abs().max()))
            agree += int((q_logits.argmax(-1) == ref_logits.argmax(-1)).sum())
            positions, blocks = positions + k - 1, blocks + 1
        if with_tau:
            for quantized, taus in ((False, taus_ref), (True, taus_quantized)):
                taus += offline_tau(
                    lambda a: draft_candidates(logits(a, quantized), drafter.draft_ids)[0][:, 0],
                    seq.tokens,
                    seq.prompt_len,
                )
    if not blocks:
        raise LoopspecError("no draft block to measure (the evaluation prompts have no response tokens)")
    out = {
        "max_abs": round(max_err, 4),
        "mean_abs": round(abs_sum / positions, 5),
        "logit_scale": round(scale, 3),
        "top1_agreement": round(agree / positions, 4),
        "blocks": blocks,
        "positions": positions,
    }
    if with_tau and taus_ref:
        tau_ref, tau_q = sum(taus_ref) / len(taus_ref), sum(taus_quantized) / len(taus_quantized)
        out.update(
            tau_reference=round(tau_ref, 4),
            tau_quantized=round(tau_q, 4),
            tau_relative_drop=round((tau_ref - tau_q) / tau_ref, 4),
            anchors=len(taus_ref),
        )
    return out


@torch.no_grad()
def drafter_logit_error(
    onnx_dir: str | Path,
    target: Target,
    drafter: Drafter,
    sequences: list[CalibSequence],
    num_threads: int | None = None,
) -> dict:
    """compare_drafters with the exported drafter run by the ONNX Runtime engine (FP8 graphs), called
    as decoding calls it: the sequence's taps appended to its context, a block drafted at each anchor."""
    from loopspec.engines.backends import artifact_engine

    k = drafter.cfg.block_size
    engine = artifact_engine(
        "onnxruntime", onnx_dir, max_context=max(len(s.tokens) for s in sequences) + k, num_threads=num_threads
    )

    def quantized_drafter(taps):
        engine.context_rollback([0], [0])

        def hidden(block, a):  # row 0's context is made to hold the positions before a
            length = engine.context_lengths([0])[0]
            if a < length:
                engine.context_rollback([0], [a])
            elif a > length:
                engine.append_context(taps[:, length:a], [a - length])
            return engine.draft([0], [int(block[0, 0])], [a], k)[2]  # the engine builds the same block

        return hidden

    return compare_drafters(target, drafter, sequences, quantized_drafter)


@torch.no_grad()
def emulated_drafter_check(
    target: Target,
    drafter: Drafter,
    weights: dict[str, QuantizedWeight],
    sequences: list[CalibSequence],
    precision: str,
) -> dict:
    """compare_drafters with the quantized drafter emulated in PyTorch (qdq_copy: the Q/DQ arithmetic of
    its graphs, run eagerly — for NVFP4 the emulation of TensorRT's FP4 kernels), τ included; `passed`
    when the offline τ drop is within the precision's tolerance (convert/validate.py TOLERANCES)."""
    from loopspec.convert.qdq import qdq_copy
    from loopspec.convert.validate import TOLERANCES
    from loopspec.engines.export import DrafterBlock, DrafterContext

    # the modules the graphs are exported from, run eagerly: the same fused GEMMs and Q/DQ as the graphs
    quantized = qdq_copy(drafter, weights).eval()
    context_module = DrafterContext(quantized, from_taps=True)
    block_module = DrafterBlock(quantized, target.embed_tokens.weight, target.lm_head.weight)
    k = drafter.cfg.block_size

    def quantized_drafter(taps):
        ctx_k, ctx_v = context_module(taps, torch.arange(taps.shape[1])[None])

        def hidden(block, a):
            room = (0, 0, 0, k)  # the block's slots after the context (engines/specs.py past_width)
            return block_module(
                block,
                torch.arange(a, a + k)[None],
                F.pad(ctx_k[:, :, :, :a], room),
                F.pad(ctx_v[:, :, :, :a], room),
                torch.tensor([a]),
            )[2]

        return hidden

    out = compare_drafters(target, drafter, sequences, quantized_drafter, with_tau=True)
    limit = TOLERANCES[precision]["tau_drop"]
    out["tau_drop_limit"] = limit
    out["passed"] = bool(limit is None or out.get("tau_relative_drop", 0.0) <= limit)
    return out


# --------------------------------------------------------------------------------------------------
# `loopspec convert quantize`

REPORT = "quantize.json"
NVFP4_EMULATED = (
    "NVFP4 drafter measured through a PyTorch emulation of its arithmetic on the CPU; the NVFP4 "
    "graphs themselves need TensorRT on a Blackwell GPU"
)
REJECTED_SUFFIX = ".rejected"  # where artifacts that failed validation are kept aside: OUT.rejected/


class ValidationFailed(LoopspecError):
    """The artifacts were built but failed validation against the fp32 reference. `--out` is left as
    it was (a TensorRT-LLM or ONNX Runtime deployment pointed at it keeps its last good artifacts);
    the rejected artifacts and their report are kept aside in `path` for inspection."""

    def __init__(self, message: str, report: dict, path: Path):
        super().__init__(message)
        self.report, self.path = report, path


def rejected_dir(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + REJECTED_SUFFIX)


def failed_checks(validation: dict) -> list[str]:
    """Each failed check of a `validate_onnx` report as one phrase: what, measured, allowed (the same
    rules as the report's `passed`)."""
    tolerance, out = validation["tolerance"], []
    for engine, r in validation["engines"].items():
        if not r["passed"]:
            output, error = max(((k, v) for k, v in r["errors"].items() if k != "draft_ids"), key=lambda kv: kv[1])
            out.append(f"{engine} {output} relative error {error:.3g} > allowed {tolerance['relative']:g}")
    if validation["precision"] == "fp32" and not validation["greedy_identical"]:
        out.append("greedy decoding differs from PyTorch (allowed: identical)")
    a = validation.get("acceptance")
    if a is not None and not a["passed"]:
        out.append(
            f"offline tau drop {a['relative_drop']:.1%} > allowed {tolerance['tau_drop']:.0%} "
            f"(PyTorch {a['tau_reference']:.3f}, ONNX {a['tau_onnx']:.3f})"
        )
    if not out and not validation["passed"]:
        out.append("validation did not pass")
    return out


def quantize_pair(
    *,
    target: str,
    drafter: str,
    out_dir: str | Path,
    precision: str,
    calib_prompts: str | Path | None = None,
    calib_size: int = DEFAULT_CALIB_SIZE,
    target_too: bool = False,
    max_context: int | None = None,
    mask_token_id: int | None = None,
    validate: bool = True,
    num_threads: int | None = None,
) -> dict:
    """Calibrate, export and check; → the report (also written to `out_dir`/quantize.json).

    out_dir/drafter   z-lab checkpoint, modelopt-quantized (config.json, model.safetensors, hf_quant_config.json)
    out_dir/target    HF checkpoint of the quantized target (with target_too)
    out_dir/onnx      the four engines (quantized drafter graphs), manifest precision = `precision`
    FP8: ONNX Runtime runs the engines; the drafter's logit error, the offline τ and greedy identity are
    measured against the fp32 reference. NVFP4: ONNX Runtime cannot run its graphs, so the drafter's
    logit error and offline τ are measured through the PyTorch emulation of NVFP4 (convert/qdq.py).

    Written staged: `out_dir` is replaced only by artifacts that passed every check. A failed FP8 validation (FP8, or
    the NVFP4 emulation's τ drop) leaves `out_dir` as it was, keeps the artifacts and report aside in `out_dir`.rejected
    (its onnx/manifest.json says `validation.passed: false`) and raises ValidationFailed."""
    import time

    from loopspec.convert.qdq import check_onnx, export_quantized_engines

    check_precision(precision)
    require_modelopt()
    if calib_size < 1:
        raise LoopspecError(f"--calib-size must be >= 1, got {calib_size}")
    prompts = read_calib_prompts(calib_prompts)  # a missing or malformed file fails before any work
    out_dir = check_out_dir(out_dir, REPORT, "a quantize output directory")
    rejected = check_out_dir(rejected_dir(out_dir), REPORT, "a quantize output directory")
    untouched = "is unchanged" if out_dir.exists() else "was not written"
    if num_threads:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    if drafter in (None, "none"):
        raise LoopspecError("quantize needs a drafter (got --drafter none)")
    pair = load_pair(target, drafter, mask_token=mask_token_id, trained=True)  # plain fp32 modules: modelopt
    target_dir, target_model, tokenizer = pair.target_dir, pair.target, pair.tokenizer  # quantizes nn.Linear
    drafter_dir, drafter_model = pair.drafter_dir, pair.drafter
    sequences = calibration_sequences(target_model, tokenizer, prompts, calib_size)
    calibration = {
        "tool": "nvidia-modelopt",
        "config": MODELOPT_CONFIG_NAMES[precision],
        "algorithm": "max",
        "prompts": str(calib_prompts) if calib_prompts else "built-in",
        "calib_size": len(sequences),
        "tokens": sum(len(s.tokens) for s in sequences),
        "new_tokens_per_prompt": DEFAULT_CALIB_NEW_TOKENS,
    }
    qdrafter = quantize_drafter(drafter_model, target_model, sequences, precision)
    with staged_dir(out_dir) as work:  # out_dir changes only when everything below succeeds
        export_drafter_checkpoint(qdrafter, work / "drafter")
        report = {
            "precision": precision,
            "calibration": calibration,
            "checkpoints": {"drafter": check_checkpoint(work / "drafter")},
        }
        target_weights = None
        if target_too:
            qtarget = quantize_target(target_model, sequences, precision)
            export_target_checkpoint(qtarget, target_dir, work / "target")
            report["checkpoints"]["target"] = check_checkpoint(work / "target")
            target_weights = quantized_weights(qtarget)
        drafter_weights = quantized_weights(qdrafter)
        export_quantized_engines(
            target_model,
            drafter_model,
            work / "onnx",
            precision=precision,
            drafter_weights=drafter_weights,
            target_weights=target_weights,
            target_dir=target_dir,
            drafter_dir=drafter_dir,
            max_context=max_context,
            quantization=calibration,
        )
        report["onnx"] = check_onnx(work / "onnx")
        if precision == "nvfp4":
            # ONNX Runtime cannot run the NVFP4 graphs (TensorRT's FP4 op): the drafter is measured
            # through the PyTorch emulation of the same arithmetic instead
            report["numerics"] = NVFP4_EMULATED
            if validate:
                from loopspec.convert.validate import PROMPT_TEXTS

                held_out = calibration_sequences(target_model, tokenizer, list(PROMPT_TEXTS), len(PROMPT_TEXTS))
                check = emulated_drafter_check(target_model, drafter_model, drafter_weights, held_out, precision)
                report["emulated"] = check
                report["failed_checks"] = (
                    []
                    if check["passed"]
                    else [
                        f"offline tau drop {check['tau_relative_drop']:.1%} > allowed {check['tau_drop_limit']:.0%} "
                        f"(fp32 {check['tau_reference']:.3f}, emulated nvfp4 {check['tau_quantized']:.3f})"
                    ]
                )
        elif validate:
            from loopspec.convert.validate import PROMPT_TEXTS, validate_onnx

            report["validation"] = validate_onnx(
                work / "onnx", target_model, drafter_model, precision, num_threads=num_threads
            )  # also recorded in onnx/manifest.json
            held_out = calibration_sequences(target_model, tokenizer, list(PROMPT_TEXTS), len(PROMPT_TEXTS))
            report["drafter_logits"] = drafter_logit_error(
                work / "onnx", target_model, drafter_model, held_out, num_threads
            )
            report["failed_checks"] = failed_checks(report["validation"])
        report["seconds"] = round(time.perf_counter() - t0, 1)
        (work / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if report.get("failed_checks"):
            replace_dir(work, rejected)  # kept aside, whole; staged_dir then has nothing left to swap in
            more = f" (and {len(report['failed_checks']) - 1} more)" if len(report["failed_checks"]) > 1 else ""
            raise ValidationFailed(
                f"{precision} validation failed: {report['failed_checks'][0]}{more}; {out_dir} "
                f"{untouched}, the rejected artifacts and their report are in {rejected}",
                report,
                rejected,
            )
    return report


def format_quantize_report(report: dict, out_dir: str | Path) -> str:
    out_dir = Path(out_dir)
    c = report["calibration"]
    lines = [
        f"modelopt {report['precision'].upper()} calibration on {c['calib_size']} prompts ({c['tokens']} tokens, "
        f"{c['prompts']}); calibration, export and checks took {report['seconds']} s"
    ]
    for name, info in report["checkpoints"].items():
        lines.append(f"  {out_dir / name}: {info['quant_algo']} checkpoint, {info['quantized']} quantized linears")
    engines = ", ".join(f"{e} ({v['quantized_weights']} weights)" for e, v in report["onnx"].items())
    lines.append(f"  {out_dir / 'onnx'}: quantized engines {engines}")
    if "numerics" in report:
        lines.append(f"  {report['numerics']}")
    if "emulated" in report:
        e = report["emulated"]
        lines.append(
            f"  emulated drafter logits vs fp32 over {e['positions']} draft positions: max |err| "
            f"{e['max_abs']:.3g}, mean |err| {e['mean_abs']:.3g} (logit scale {e['logit_scale']:.3g}), "
            f"top-1 agreement {e['top1_agreement']:.1%}"
        )
        if "tau_reference" in e:
            lines.append(
                f"  offline tau over {e['anchors']} anchors: fp32 {e['tau_reference']:.3f}, emulated "
                f"{e['tau_quantized']:.3f} (drop {e['tau_relative_drop']:+.1%}, limit {e['tau_drop_limit']:.0%}): "
                f"{'PASSED' if e['passed'] else 'FAILED'}"
            )
    if "drafter_logits" in report:
        d = report["drafter_logits"]
        lines.append(
            f"  drafter logits vs fp32 over {d['positions']} draft positions: max |err| {d['max_abs']:.3g}, "
            f"mean |err| {d['mean_abs']:.3g} (logit scale {d['logit_scale']:.3g}), "
            f"top-1 agreement {d['top1_agreement']:.1%}"
        )
    if "validation" in report:
        from loopspec.convert.validate import format_report

        lines.append(format_report(report["validation"]))
    return "\n".join(lines)
