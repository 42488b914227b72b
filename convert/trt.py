"""TensorRT plans from an ONNX artifact directory: `loopspec convert trt --onnx DIR --out DIR`.

Each engine's ONNX graph is parsed into a strongly typed network (the graph's own types decide every
tensor's precision: fp32 graphs stay fp32, modelopt FP8/NVFP4 QDQ graphs run in FP8/FP4), built with
one optimization profile taken from its EngineSpec ranges (the spec the export declared; `max_batch`
narrows its rows, since TensorRT sizes activation memory for the profile's largest shapes), and
serialized to `<engine>.plan`. The configs and tokenizer travel along, and `manifest.json` (stage
"tensorrt") records the GPU, its compute capability and the TensorRT version the plans were built
for: a plan runs only on that GPU architecture and TensorRT version, and `settings.arithmetic` what the
plans compute with (fp32 plans have TF32 cleared; only they verify draft trees, the others chains:
engines/trt_engine.py plan_arithmetic).

tensorrt is imported lazily; without it, or without a GPU, the command stops with a clear error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from loopspec.engines.manifest import Manifest, read_manifest, tool_versions, write_manifest
from loopspec.weights import file_sha256
from loopspec.engines.staging import check_out_dir, staged_dir
from loopspec.engines.trt_engine import (
    builder_flags,
    check_precision_supported,
    cuda_capability,
    plan_arithmetic,
    profile_shapes,
    require_tensorrt,
)
from loopspec.errors import LoopspecError

WEIGHT_SUFFIXES = (".onnx", ".data", ".onnx_data")  # the graphs and their external weights: replaced by plans


def _errors(parser) -> str:
    return "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or "no parser message"


def build_plan(
    trt, builder, logger, onnx_path: Path, spec, workspace_bytes: int | None, precision: str = "fp32"
) -> bytes:
    """Parse one ONNX graph into a strongly typed network and build its plan for the spec's ranges
    (an fp32 plan with TF32 cleared: engines/trt_engine.py plan_arithmetic)."""
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads external weights next to the file
        raise LoopspecError(f"TensorRT cannot parse {onnx_path}: {_errors(parser)}")
    inputs = sorted(network.get_input(i).name for i in range(network.num_inputs))
    outputs = sorted(network.get_output(i).name for i in range(network.num_outputs))
    if inputs != sorted(spec.input_names) or outputs != sorted(spec.output_names):
        raise LoopspecError(f"{onnx_path} does not match its spec {spec.name}: inputs {inputs}, outputs {outputs}")
    config = builder.create_builder_config()
    to_set, to_clear = builder_flags(trt, precision)
    for flag in to_set:
        config.set_flag(flag)
    for flag in to_clear:
        config.clear_flag(flag)
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    profile = builder.create_optimization_profile()
    for name, lo, opt, hi in profile_shapes(spec):
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise LoopspecError(f"TensorRT could not build {spec.name} from {onnx_path} (its log above says why)")
    return bytes(plan)


def build_plans(
    onnx_dir: str | Path,
    out_dir: str | Path,
    precision: str | None = None,
    workspace_gb: float | None = None,
    max_batch: int | None = None,
) -> Manifest:
    """Every engine of `onnx_dir` → a TensorRT plan in `out_dir` (written atomically) + manifest.
    `max_batch`: the most rows per call the plans take (default: the ONNX export's range)."""
    trt = require_tensorrt()
    capability, device = cuda_capability()
    source = read_manifest(onnx_dir)  # hashes verified: a changed graph is refused before building
    if precision is not None and precision != source.precision:
        raise LoopspecError(
            f"{onnx_dir} holds {source.precision} graphs; a strongly typed build keeps the graph's "
            f"types, so {precision} plans need {precision} graphs (export or quantize them first)"
        )
    precision = source.precision
    check_precision_supported(precision, capability, device)
    if workspace_gb is not None and workspace_gb <= 0:
        raise LoopspecError(f"--workspace-gb must be > 0, got {workspace_gb}")
    out = check_out_dir(out_dir, "manifest.json", "an artifact directory")

    with staged_dir(out) as tmp:
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        specs, files = {}, {}
        for name in source.engines:
            specs[name] = source.spec(name) if max_batch is None else source.spec(name).narrowed("batch", max_batch)
            files[name] = f"{name}.plan"
            plan = build_plan(
                trt,
                builder,
                logger,
                source.path(name),
                specs[name],
                int(workspace_gb * (1 << 30)) if workspace_gb else None,
                precision,
            )
            (tmp / files[name]).write_bytes(plan)
        engine_files = {source.data["engines"][n]["file"] for n in source.engines}
        for rel in source.data["files"]:  # configs, tokenizer, d2t: what running the plans needs besides them
            if rel in engine_files or rel.endswith(WEIGHT_SUFFIXES):
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(onnx_dir) / rel, tmp / rel)
        settings = {
            **source.data.get("settings", {}),
            "device": device,
            "compute_capability": f"{capability[0]}.{capability[1]}",
            "workspace_gb": workspace_gb,
            "arithmetic": plan_arithmetic(precision),
        }
        manifest = write_manifest(
            tmp,
            stage="tensorrt",
            precision=precision,
            specs=specs,
            engine_files=files,
            sources={
                "onnx": {
                    "path": str(Path(onnx_dir).resolve()),
                    "manifest_sha256": file_sha256(Path(onnx_dir) / "manifest.json"),
                }
            },
            settings=settings,
            tools=tool_versions(("tensorrt", "torch", "loopspec")),
            parent={k: v for k, v in source.data.items() if k != "files"},
        )
    return Manifest(out, manifest.data)
