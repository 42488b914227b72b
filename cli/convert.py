"""`loopspec convert <stage>`: artifacts out, by stage (onnx, quantize, trt, bundle)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loopspec.cli.flags import (
    DeprecatedSpelling,
    add_mask_token_flag,
    add_target_flag,
    add_threads_flag,
    int_at_least,
    positive_int,
)
from loopspec.errors import LoopspecError
from loopspec.files import output_dir
from loopspec.precisions import precision_names

# what `convert onnx` exports a pair in (loopspec/precisions.py), and what `convert quantize` makes
PAIR_PRECISIONS = precision_names(backend="onnxruntime", weights=("fp32", "gguf"))
QUANTIZED_PRECISIONS = precision_names(weights=("modelopt",))
MAX_CONTEXT_HELP = "largest context in the engine specs' ranges (default: the models' max positions)"


def _add_onnx_args(p: argparse.ArgumentParser) -> None:
    add_target_flag(p)
    p.add_argument(
        "--drafter",
        default="default",
        help="'default', a DFlash / DSpark / EAGLE-3 drafter dir, or 'none' (the target engine alone: ar only)",
    )
    p.add_argument("--out", required=True, help="artifact directory (an earlier export there is replaced)")
    p.add_argument("--max-context", type=positive_int("--max-context"), default=None, help=MAX_CONTEXT_HELP)
    add_mask_token_flag(p)
    add_threads_flag(p, "CPU threads")
    p.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every engine against the PyTorch reference (default on)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=PAIR_PRECISIONS,
        help="fp32 (default) | gguf-fp32act | gguf-int8act | gguf-fused: the target's matrices as its "
        "GGUF's own blocks (ONNX Runtime MatMulNBits) with fp32 or int8 activations; gguf-fused in ONNX "
        "Runtime's fused ops, chains only (--target default or FILE.gguf)",
    )


def cmd_onnx(args) -> int:
    import torch

    from loopspec.convert.onnx_export import convert_onnx
    from loopspec.convert.validate import format_report
    from loopspec.pair import load_pair
    from loopspec.weights import TargetSource

    if args.threads:
        torch.set_num_threads(args.threads)
    target = TargetSource.of(args.target)
    gguf_path = target.require_gguf("the GGUF block precisions") if args.precision != "fp32" else None
    pair = load_pair(target, args.drafter, mask_token=args.mask_token_id)  # as generate resolves it
    manifest, report = convert_onnx(
        pair.target,
        pair.drafter,
        args.out,
        target_dir=pair.target_dir,
        drafter_dir=pair.drafter_dir,
        max_context=args.max_context,
        validate=args.validate,
        num_threads=args.threads,
        precision=args.precision,
        gguf_path=gguf_path,
    )
    print(f"exported {', '.join(manifest.engines)} ({manifest.precision}) to {args.out}")
    if report is not None:
        print(format_report(report))
        if not report["passed"]:
            raise LoopspecError(f"validation failed (the report is in {Path(args.out) / 'manifest.json'})")
    return 0


def _add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", required=True, help=" | ".join(QUANTIZED_PRECISIONS))
    add_target_flag(p)
    p.add_argument("--drafter", default="default", help="'default' or a trained z-lab DFlash drafter dir")
    p.add_argument(
        "--out",
        required=True,
        help="output directory: drafter/, target/ (--target-too), onnx/, quantize.json; replaced only "
        "by artifacts that pass validation (failed ones are kept in OUT.rejected/, exit code 2)",
    )
    p.add_argument("--calib-prompts", default=None, help='JSONL of {"turns": [...]} (default: built-in prompts)')
    p.add_argument("--calib-size", type=positive_int("--calib-size"), default=16, help="calibration prompts")
    p.add_argument("--target-too", action="store_true", help="also quantize the target (checkpoint and ONNX graph)")
    p.add_argument("--max-context", type=positive_int("--max-context"), default=None, help=MAX_CONTEXT_HELP)
    add_mask_token_flag(p)
    add_threads_flag(p, "CPU threads")
    p.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp8: measure the ONNX Runtime engines against the fp32 reference; a failed check "
        "leaves --out unchanged and exits 2 (default on)",
    )


def cmd_quantize(args) -> int:
    from loopspec.convert.quantize import ValidationFailed, format_quantize_report, quantize_pair

    try:
        report = quantize_pair(
            target=args.target,
            drafter=args.drafter,
            out_dir=args.out,
            precision=args.precision,
            calib_prompts=args.calib_prompts,
            calib_size=args.calib_size,
            target_too=args.target_too,
            max_context=args.max_context,
            mask_token_id=args.mask_token_id,
            validate=args.validate,
            num_threads=args.threads,
        )
    except ValidationFailed as e:
        print(format_quantize_report(e.report, e.path))  # the full report, then the one-line error
        raise
    print(format_quantize_report(report, args.out))
    return 0


def _add_trt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--onnx", required=True, help="ONNX artifact directory (`convert onnx`, or `convert quantize`'s onnx/)"
    )
    p.add_argument("--out", required=True, help="plan directory (an earlier build there is replaced)")
    p.add_argument(
        "--precision",
        default=None,
        help="fp32 | fp8 | nvfp4: require graphs of this precision (default: the graphs' own)",
    )
    p.add_argument("--workspace-gb", type=float, default=None, help="TensorRT builder workspace limit")
    p.add_argument(
        "--max-batch",
        type=positive_int("--max-batch"),
        default=None,
        help="rows per engine call the plans take (default: the ONNX export's, 16); "
        "TensorRT sizes its memory for the largest",
    )


def cmd_trt(args) -> int:
    from loopspec.convert.trt import build_plans

    manifest = build_plans(
        args.onnx, args.out, precision=args.precision, workspace_gb=args.workspace_gb, max_batch=args.max_batch
    )
    built_for = manifest.data["settings"]
    print(
        f"built {', '.join(manifest.engines)} ({manifest.precision}) TensorRT plans for {built_for['device']} "
        f"(compute capability {built_for['compute_capability']}) in {args.out}"
    )
    return 0


def _add_bundle_args(p: argparse.ArgumentParser) -> None:
    frameworks = p.add_mutually_exclusive_group(required=True)
    frameworks.add_argument(
        "--framework",
        help="trtllm | vllm | sglang | llamacpp, a comma-separated list, or all "
        "(every serving framework that can serve the target: llamacpp needs "
        "a GGUF target, 'default' or a .gguf file)",
    )
    frameworks.add_argument(
        "--engine", dest="framework", action=DeprecatedSpelling, instead="--framework", help=argparse.SUPPRESS
    )
    add_target_flag(p)
    p.add_argument(
        "--drafter",
        default="default",
        help="'default' (the shipped drafter), a z-lab DFlash drafter dir, a DSpark "
        "drafter dir (DeepSpec's format), or an EAGLE-3 drafter dir (SpecForge's layout)",
    )
    p.add_argument("--out", required=True, help="bundle directory (an earlier bundle there is replaced)")
    p.add_argument(
        "--precision", default=None, help="fp8 | nvfp4: a modelopt-quantized target (NVFP4 runs on Blackwell GPUs only)"
    )
    p.add_argument("--tp", type=positive_int("--tp"), default=1, help="tensor-parallel size of every launch")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32: the unquantized weights")
    p.add_argument(
        "--max-batch-size",
        type=positive_int("--max-batch-size"),
        default=8,
        help="requests decoding at once: TensorRT-LLM max_batch_size and cuda_graph_config.max_batch_size, "
        "vLLM --max-num-seqs, SGLang --max-running-requests (default 8)",
    )
    p.add_argument(
        "--max-context",
        type=positive_int("--max-context"),
        default=None,
        help="tokens per request, prompt + output: TensorRT-LLM max_seq_len (and max_num_tokens, with "
        "--max-batch-size), vLLM --max-model-len, SGLang --context-length, llama-server -c "
        "(default: 4096, or the target's maximum if smaller)",
    )
    add_threads_flag(p, "llamacpp: llama-server's -t in its launch script (default: all cores; THREADS overrides it)")
    p.add_argument(
        "--block-size",
        type=int_at_least("--block-size", 2),
        default=None,
        metavar="K",
        help="EAGLE-3 drafter: the engines draft K - 1 tokens per verification (default: the drafter's "
        "stored setting, else its block size)",
    )
    p.add_argument(
        "--tree-budget",
        type=int_at_least("--tree-budget", 0),
        default=None,
        metavar="N",
        help="EAGLE-3 drafter: verify a draft tree of N nodes (0 = the chain; default: the drafter's "
        "stored setting, else 0); TensorRT-LLM and SGLang take trees",
    )
    add_mask_token_flag(p)
    p.add_argument("--calib-prompts", default=None, help='--precision: JSONL of {"turns": [...]} (default: built-in)')
    p.add_argument(
        "--calib-size", type=positive_int("--calib-size"), default=None, help="--precision: calibration prompts"
    )


def cmd_bundle(args) -> int:
    from loopspec.convert.bundles import FRAMEWORKS, build_bundle

    # the frameworks go positionally: the command line does not depend on what build_bundle names them
    manifest = build_bundle(
        args.target,
        args.drafter,
        args.out,
        args.framework,
        precision=args.precision,
        tp=args.tp,
        dtype=args.dtype,
        mask_token_id=args.mask_token_id,
        max_batch_size=args.max_batch_size,
        max_context=args.max_context,
        calib_prompts=args.calib_prompts,
        calib_size=args.calib_size,
        threads=args.threads,
        setting={"block_size": args.block_size, "tree_budget": args.tree_budget},
    )
    print(f"serving bundle ({manifest['precision']}, tensor parallel {manifest['tensor_parallel_size']}) in {args.out}")
    for framework in manifest["engines"]:
        print(f"  {FRAMEWORKS[framework].title}: sh {Path(args.out) / framework / 'launch.sh'}")
    if args.precision == "nvfp4":
        print("  NVFP4 runs only on Blackwell GPUs (compute capability >= 10.0)")
    return 0


# stage → (help, arguments, command): `loopspec convert <stage>`
STAGES = {
    "onnx": (
        "export the target (+ drafter) engines as ONNX (fp32, or the target over its GGUF blocks), with "
        "manifest.json, and validate them",
        _add_onnx_args,
        cmd_onnx,
    ),
    "quantize": (
        "modelopt FP8 / NVFP4 calibration of the drafter (and target): HF checkpoints + ONNX engines",
        _add_quantize_args,
        cmd_quantize,
    ),
    "trt": ("build TensorRT plans from ONNX engines (needs TensorRT and an NVIDIA GPU)", _add_trt_args, cmd_trt),
    "bundle": (
        "a TensorRT-LLM / vLLM / SGLang / llama.cpp serving bundle: z-lab drafter (a DSpark drafter: "
        "DeepSpec's layout, or a GGUF with its heads; an EAGLE-3 drafter: SpecForge's layout), HF target "
        "(or the drafter as a llama.cpp GGUF beside the target GGUF), launch files",
        _add_bundle_args,
        cmd_bundle,
    ),
}


def add_convert(sub) -> None:
    c = sub.add_parser("convert", help=f"artifacts out, by stage: {', '.join(STAGES)}")
    stages = c.add_subparsers(dest="stage", required=True)
    for stage, (help_text, add_args, _) in STAGES.items():
        add_args(stages.add_parser(stage, help=help_text))


def cmd_convert(args) -> int:
    with output_dir(args.out, "--out"):  # writable before any work; left as it was if the stage fails
        return STAGES[args.stage][2](args)
