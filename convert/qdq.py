"""Quantized linears for ONNX export: the weight stored quantized, Q/DQ in the graph.

FP8 (opset 19): standard `QuantizeLinear` / `DequantizeLinear` with float8e4m3fn zero points, the
pattern TensorRT fuses into FP8 GEMMs and ONNX Runtime runs on a CPU:
    x → QuantizeLinear(input_scale) → DequantizeLinear ─┐
    weight float8 [in, out] → DequantizeLinear(weight_scale) → MatMul (+ bias)
NVFP4 (opset 23): modelopt's NVFP4 ONNX pattern:
    x → trt::TRT_FP4DynamicQuantize(input_scale, block 16) → (x float4, scales float8)
      → DequantizeLinear(scales, input_scale) → DequantizeLinear(x, ·, block 16) ─┐
    weight float4e2m1 [out, in] → DequantizeLinear(DequantizeLinear(weight_scale float8 [out, in/16],
      weight_scale_2), block 16) → Transpose → MatMul
TRT_FP4DynamicQuantize is a TensorRT op: NVFP4 graphs run only on TensorRT with a Blackwell GPU.

The ops are torch custom ops (`loopspec::…`) translated to ONNX by `translations(precision)` (the
dynamo exporter's custom_translation_table). Eagerly, the FP8 ops compute exactly what the ONNX ops
compute (saturating round-to-nearest-even float8); the NVFP4 ops emulate in PyTorch what TensorRT's FP4
kernels compute (e2m1 codes, e4m3 block scales, fp32 tensor scale), so a CPU measures an NVFP4
drafter's accuracy (convert/quantize.py) although ONNX Runtime cannot run its graphs. The modules carry
the tensors convert/quantize.py computes with modelopt (`QuantizedWeight`); `engines/export.py`'s
wrappers call them as they are (`exports_itself`) and fuse them (`fused`: one input scale, weights side
by side) where the graph has one GEMM for several.

`export_quantized_engines` writes the four engines of a pair with these graphs into an artifact
directory (manifest stage "quantized"); `check_onnx` verifies the Q/DQ structure of what it wrote.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.engines.export import (
    OPSET,
    DrafterBlock,
    DrafterContext,
    TargetVerify,
    copy_run_files,
    drafter_source,
    example_inputs,
    export_graph,
)
from loopspec.engines.manifest import Manifest, read_manifest, source_hashes, tool_versions, write_manifest
from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, TARGET_VERIFY, engine_specs
from loopspec.engines.staging import check_out_dir, staged_dir
from loopspec.errors import LoopspecError
from loopspec.precisions import precision_names
from loopspec.model.dflash import Drafter
from loopspec.model.target import Target

FP8_MAX = 448.0  # largest finite float8 e4m3fn
NVFP4_BLOCK = 16
FP8_OPSET = 19  # QuantizeLinear / DequantizeLinear with float8 types
NVFP4_OPSET = 23  # float4e2m1 and blocked DequantizeLinear


@torch.library.custom_op("loopspec::fp8_qdq", mutates_args=())
def fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Activations through float8 e4m3 at a per-tensor scale and back (QuantizeLinear saturate=1)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


@fp8_qdq.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("loopspec::fp8_dequantize", mutates_args=())
def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 weight [in, out] × scale (scalar, or one per output column) → float32 [in, out]."""
    return weight.to(torch.float32) * scale


@fp8_dequantize.register_fake
def _(weight, scale):
    return torch.empty(weight.shape, dtype=torch.float32, device=weight.device)


# NVFP4 as NVIDIA defines it (Model Optimizer's NVFP4 export, TensorRT's FP4 kernels): 4-bit e2m1
# codes (bit 3 the sign, bits 0-2 index E2M1_VALUES), one float8 e4m3 scale per block of 16 values
# along the last axis, and one fp32 scale per tensor (amax / (6 * 448)), so a value is
# e2m1 × block scale × tensor scale. A block's scale is amax(block) / (6 × tensor scale) rounded to e4m3.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float → uint8 e2m1 codes: the nearest magnitude (ties to the even code, as IEEE rounding does),
    saturating at ±6; bit 3 carries the sign."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    magnitude = x.abs().float().clamp_max(E2M1_MAX)
    lower = (torch.searchsorted(values, magnitude, right=True) - 1).clamp(0, 6)  # the largest value <= magnitude
    below, above = magnitude - values[lower], values[lower + 1] - magnitude
    upper = (above < below) | ((above == below) & (lower % 2 == 1))  # a tie goes to the even code
    return ((lower + upper.long()) | torch.where(x < 0, 8, 0)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes → float32 values."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = values[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2], two codes a byte, low nibble first (modelopt's packing) → codes [..., n]."""
    packed = packed.view(torch.uint8)
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % NVFP4_BLOCK:
        raise LoopspecError(f"NVFP4 needs the last dimension to be a multiple of {NVFP4_BLOCK}, got {x.shape[-1]}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


@torch.library.custom_op("loopspec::nvfp4_qdq", mutates_args=())
def nvfp4_qdq(x: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Activations through NVFP4 and back, as TRT_FP4DynamicQuantize + the two DequantizeLinear compute
    it: each block of 16 gets the e4m3 scale amax / (6 · scale_2) (saturating at 448), its values the
    nearest e2m1 of x / (block scale · scale_2). A block whose scale rounds to 0 comes back as zeros."""
    blocks = _blocks(x.float())
    block_scale = (blocks.abs().amax(-1, keepdim=True) / (E2M1_MAX * scale_2)).clamp_max(FP8_MAX)
    step = block_scale.to(torch.float8_e4m3fn).float() * scale_2  # what one e2m1 unit is worth in this block
    scaled = torch.where(step > 0, blocks / torch.where(step > 0, step, 1.0), 0.0)
    return (e2m1_values(e2m1_codes(scaled)) * step).reshape(x.shape).to(x.dtype)


@nvfp4_qdq.register_fake
def _(x, scale_2):
    return torch.empty_like(x)


@torch.library.custom_op("loopspec::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize(weight: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 weight [out, in/2] × e4m3 block scales [out, in/16] × scale_2 → float32 [out, in]."""
    values = e2m1_values(unpack_e2m1(weight))  # [out, in]
    return values * block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1) * scale_2.float()


@nvfp4_dequantize.register_fake
def _(weight, block_scale, scale_2):
    return torch.empty((weight.shape[0], weight.shape[1] * 2), dtype=torch.float32, device=weight.device)


# --------------------------------------------------------------------------------------------------
# ONNX translations (onnxscript is imported when an export asks for them)


def _fp8_zero_point(op):
    from onnx import TensorProto, helper

    return op.Constant(value=helper.make_tensor("fp8_zero_point", TensorProto.FLOAT8E4M3FN, [], [0]))


def _fp8_qdq_onnx(x, scale):
    from onnxscript import opset19 as op

    zero = _fp8_zero_point(op)
    return op.DequantizeLinear(op.QuantizeLinear(x, scale, zero, saturate=1), scale, zero)


def _fp8_dequantize_onnx(weight, scale):
    from onnxscript import opset19 as op

    return op.DequantizeLinear(weight, scale, axis=1)  # axis: the output column of [in, out] (per-tensor: ignored)


def _register_trt_fp4_quantize() -> None:
    """Declare TensorRT's TRT_FP4DynamicQuantize to ONNX (inputs x, per-tensor scale; outputs float4
    values and float8 block scales), so the exporter can emit it as modelopt's NVFP4 graphs do."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has("TRT_FP4DynamicQuantize", "trt"):
        return
    onnx.defs.register_schema(
        OpSchema(
            "TRT_FP4DynamicQuantize",
            "trt",
            1,
            inputs=[OpSchema.FormalParameter("x", "T1"), OpSchema.FormalParameter("scale", "T1")],
            outputs=[OpSchema.FormalParameter("y", "T2"), OpSchema.FormalParameter("y_scale", "T3")],
            type_constraints=[
                ("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "high precision"),
                ("T2", ["tensor(float4e2m1)"], "quantized values"),
                ("T3", ["tensor(float8e4m3fn)"], "block scales"),
            ],
            attributes=[
                OpSchema.Attribute("axis", OpSchema.AttrType.INT, "blocked axis"),
                OpSchema.Attribute("block_size", OpSchema.AttrType.INT, "block size"),
                OpSchema.Attribute("scale_type", OpSchema.AttrType.INT, "block scale data type"),
            ],
        )
    )


def _nvfp4_qdq_onnx(x, scale_2):
    import onnxscript
    from onnx import TensorProto
    from onnxscript import opset23 as op

    trt = onnxscript.values.Opset("trt", 1)
    values, scales = trt.TRT_FP4DynamicQuantize(
        x, scale_2, axis=-1, block_size=NVFP4_BLOCK, scale_type=TensorProto.FLOAT8E4M3FN
    )
    return op.DequantizeLinear(values, op.DequantizeLinear(scales, scale_2), axis=-1, block_size=NVFP4_BLOCK)


def _nvfp4_dequantize_onnx(weight, block_scale, scale_2):
    from onnxscript import opset23 as op

    return op.DequantizeLinear(weight, op.DequantizeLinear(block_scale, scale_2), axis=-1, block_size=NVFP4_BLOCK)


def translations(precision: str) -> dict:
    """torch.onnx.export's custom_translation_table for a precision's ops."""
    if precision == "fp8":
        return {
            torch.ops.loopspec.fp8_qdq.default: _fp8_qdq_onnx,
            torch.ops.loopspec.fp8_dequantize.default: _fp8_dequantize_onnx,
        }
    _register_trt_fp4_quantize()
    return {
        torch.ops.loopspec.nvfp4_qdq.default: _nvfp4_qdq_onnx,
        torch.ops.loopspec.nvfp4_dequantize.default: _nvfp4_dequantize_onnx,
    }


# --------------------------------------------------------------------------------------------------
# modules


class Fp8Linear(nn.Module):
    """y = DQ(Q(x)) · DQ(weight) (+ bias). The weight is kept transposed, [in, out], so the graph is
    DequantizeLinear → MatMul with no Transpose between them."""

    exports_itself = True  # engines/export.py's `linear` calls the module instead of reading .weight

    def __init__(
        self,
        weight_t: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.register_buffer("weight_t", weight_t.contiguous())  # float8_e4m3fn [in, out]
        self.register_buffer("weight_scale", weight_scale.float())  # scalar or [out]
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def from_quantized(cls, q) -> "Fp8Linear":
        return cls(q.weight.t(), q.weight_scale, q.input_scale, q.bias)

    @classmethod
    def fused(cls, parts: list["Fp8Linear"]) -> "Fp8Linear":
        """One linear computing every part's output, concatenated: one input scale (the parts were
        calibrated to share it), weight columns side by side with their own scales."""
        _same_input_scale(parts)
        scales = [p.weight_scale.expand(p.weight_t.shape[1]) for p in parts]
        scale = torch.cat(scales)
        if bool((scale == scale[0]).all()):
            scale = scale[0]
        bias = (
            None
            if all(p.bias is None for p in parts)
            else torch.cat([p.bias if p.bias is not None else torch.zeros(p.weight_t.shape[1]) for p in parts])
        )
        return cls(torch.cat([p.weight_t for p in parts], dim=1), scale, parts[0].input_scale, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (what the graph computes)."""
        return fp8_dequantize(self.weight_t, self.weight_scale).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(fp8_qdq(x, self.input_scale), fp8_dequantize(self.weight_t, self.weight_scale))
        return y if self.bias is None else y + self.bias


class Nvfp4Linear(nn.Module):
    """y = DQ(dynamic FP4 Q(x)) · DQ(weight)ᵀ (+ bias): weight float4e2m1 [out, in] (two per byte),
    float8 block scales [out, in/16], fp32 global scales. Eagerly it runs the PyTorch emulation of
    NVFP4 (the accuracy check); exported, the graph is modelopt's TensorRT pattern."""

    exports_itself = True

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.register_buffer("weight", weight.contiguous().view(torch.float4_e2m1fn_x2))  # [out, in/2] packed
        self.register_buffer("weight_scale", weight_scale.contiguous())  # float8_e4m3fn [out, in/16]
        self.register_buffer("weight_scale_2", weight_scale_2.float().reshape(()))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def from_quantized(cls, q) -> "Nvfp4Linear":
        return cls(q.weight, q.weight_scale, q.weight_scale_2, q.input_scale, q.bias)

    @classmethod
    def fused(cls, parts: list["Nvfp4Linear"]) -> "Nvfp4Linear":
        """Rows stacked: the parts were calibrated to share the input and global weight scales."""
        _same_input_scale(parts)
        if any(not torch.equal(p.weight_scale_2, parts[0].weight_scale_2) for p in parts):
            raise LoopspecError("cannot fuse NVFP4 linears with different global weight scales")
        bias = (
            None
            if all(p.bias is None for p in parts)
            else torch.cat([p.bias if p.bias is not None else torch.zeros(p.weight.shape[0]) for p in parts])
        )
        return cls(
            torch.cat([p.weight.view(torch.uint8) for p in parts]),
            torch.cat([p.weight_scale for p in parts]),
            parts[0].weight_scale_2,
            parts[0].input_scale,
            bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = nvfp4_dequantize(self.weight, self.weight_scale, self.weight_scale_2)  # [out, in]
        return F.linear(nvfp4_qdq(x, self.input_scale), w, self.bias)


PRECISIONS = precision_names(weights=("modelopt",))  # what `convert quantize` makes (loopspec/precisions.py)
MODULES = {"fp8": Fp8Linear, "nvfp4": Nvfp4Linear}
assert set(MODULES) == set(PRECISIONS), "one quantized linear per modelopt precision"


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise LoopspecError(f"unknown quantization precision {precision!r} (choose from {', '.join(PRECISIONS)})")


def _same_input_scale(parts) -> None:
    if any(not torch.equal(p.input_scale, parts[0].input_scale) for p in parts):
        raise LoopspecError("cannot fuse quantized linears with different input scales (calibrate them together)")


def qdq_copy(model: nn.Module, weights: dict) -> nn.Module:
    """A copy of the fp32 `model` whose Linears named in `weights` ({name: QuantizedWeight}, from
    convert/quantize.py) are the matching Fp8Linear / Nvfp4Linear."""
    out = copy.deepcopy(model)
    for name, q in weights.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        if not isinstance(getattr(parent, leaf), nn.Linear):
            raise LoopspecError(f"{name} is not a Linear of the model")
        setattr(parent, leaf, MODULES[q.precision].from_quantized(q))
    return out


# --------------------------------------------------------------------------------------------------
# export


def export_quantized_graph(module: nn.Module, spec, args: tuple, path: Path, precision: str) -> None:
    """One engine with quantized linears → `path` + `path`.data (external weights), by the dynamo
    exporter: it traces with fake tensors (the NVFP4 ops are never computed) and maps the custom ops
    through `translations`. Dynamic dims and their ranges come from the engine spec."""
    import onnx

    dims: dict[str, torch.export.Dim] = {}

    def dim(name: str):
        low, _, high = spec.ranges[name]
        return dims.setdefault(name, torch.export.Dim(name, min=low, max=high))

    shapes = [{axis: dim(d) for axis, d in t.dynamic_axes().items()} or None for t in spec.inputs]
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):  # torch.export sees `*past` as one tuple argument
        named = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        shapes = shapes[:named] + [tuple(shapes[named:])]
    dynamic_shapes = tuple(shapes)
    opset = FP8_OPSET if precision == "fp8" else NVFP4_OPSET
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's progress and deprecation chatter
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            program = torch.onnx.export(
                module.eval(),
                args,
                None,
                dynamo=True,
                opset_version=opset,
                input_names=spec.input_names,
                output_names=spec.output_names,
                dynamic_shapes=dynamic_shapes,
                custom_translation_table=translations(precision),
            )
    model = program.model_proto
    if precision == "nvfp4":
        model.ir_version = max(model.ir_version, 11)  # float4e2m1 is an IR 11 type
    path = Path(path)
    for stale in (path, path.with_name(path.name + ".data")):
        stale.unlink(missing_ok=True)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=1024,
        convert_attribute=True,
    )
    onnx.checker.check_model(str(path))


# --------------------------------------------------------------------------------------------------
# ONNX engines with quantized drafter (and target) graphs


def export_quantized_engines(
    target: Target,
    drafter: Drafter,
    out_dir: str | Path,
    *,
    precision: str,
    drafter_weights: dict,
    target_weights: dict | None = None,
    target_dir: str | Path,
    drafter_dir: str | Path | None = None,
    max_context: int | None = None,
    block_size: int | None = None,
    quantization: dict | None = None,
) -> Manifest:
    """The four engines in one artifact directory, as `convert onnx` lays it out, with the drafter's
    graphs (and the target's, given `target_weights`) quantized: FP8 as standard Q/DQ that ONNX
    Runtime runs, NVFP4 as modelopt's pattern for TensorRT. Unquantized graphs are the fp32 export.
    The manifest records stage "quantized", the precision and which engines are quantized."""
    check_precision(precision)
    out_dir, target_dir = check_out_dir(out_dir, "manifest.json", "an artifact directory"), Path(target_dir)
    limits = [target.cfg.max_position_embeddings, drafter.cfg.max_position_embeddings]
    max_context = min([max_context or min(limits)] + limits)
    specs = engine_specs(target.cfg, drafter.cfg, max_context=max_context, block_size=block_size)
    qdrafter = qdq_copy(drafter, drafter_weights)
    modules = {
        TARGET_VERIFY: TargetVerify(
            qdq_copy(target, target_weights) if target_weights else target, drafter.cfg.target_layer_ids
        ),
        DRAFTER_CONTEXT: DrafterContext(qdrafter, from_taps=True),
        DRAFTER_CONTEXT_HIDDEN: DrafterContext(qdrafter, from_taps=False),
        DRAFTER_BLOCK: DrafterBlock(qdrafter, target.embed_tokens.weight, target.lm_head.weight),
    }
    quantized = [DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK] + ([TARGET_VERIFY] if target_weights else [])

    files = {}
    with staged_dir(out_dir) as work:
        for name, module in modules.items():
            files[name] = f"{name}.onnx"
            args = example_inputs(specs[name], target.cfg.vocab_size)
            if name in quantized:
                export_quantized_graph(module, specs[name], args, work / files[name], precision)
            else:
                export_graph(module, specs[name], args, work / files[name], OPSET)
        copy_run_files(target_dir, drafter, work)
        opsets = {
            name: (FP8_OPSET if precision == "fp8" else NVFP4_OPSET) if name in quantized else OPSET for name in modules
        }
        settings = {
            "opset": opsets,
            "max_context": max_context,
            "block_size": specs[DRAFTER_BLOCK].ranges["block"][1],
            "target_layer_ids": drafter.cfg.target_layer_ids,
            "quantized_engines": quantized,
            "exporter": {
                "quantized": "torch.onnx.export (dynamo, custom Q/DQ translations)",
                "fp32": "torch.onnx.export (TorchScript)",
            },
            "quantization": quantization or {},
        }
        sources = {"target": source_hashes(target_dir), "drafter": drafter_source(drafter, drafter_dir)}
        write_manifest(
            work,
            stage="quantized",
            precision=precision,
            specs=specs,
            engine_files=files,
            sources=sources,
            settings=settings,
            tools=tool_versions(("torch", "onnx", "onnxruntime", "onnxscript", "nvidia-modelopt", "loopspec")),
        )
    return Manifest(out_dir, json.loads((out_dir / "manifest.json").read_text()))


def check_onnx(onnx_dir: str | Path) -> dict:
    """Verify the quantized engines' graphs: FP8 → QuantizeLinear/DequantizeLinear pairs with float8e4m3fn
    zero points and float8 weights; NVFP4 → float4e2m1 weights behind two DequantizeLinear (float8 block
    scales of 1/16 of the row, blocked axis -1, block 16) and TRT_FP4DynamicQuantize on activations.
    → {engine: {"quantized_weights": n, "activation_quantizers": m}}."""
    import onnx
    from onnx import TensorProto

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
            bad = [
                n.name
                for n in quantize
                if len(n.input) < 3 or _elem_type(n.input[2], inits, producers) != TensorProto.FLOAT8E4M3FN
            ]
            if bad or not quantize:
                raise LoopspecError(f"{engine}: activation QuantizeLinear without a float8e4m3fn zero point: {bad}")
            weight_dq = [
                n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in {w.name for w in weights}
            ]
        else:
            weights = [i for i in inits.values() if i.data_type == TensorProto.FLOAT4E2M1]
            quantize = [n for n in nodes if n.op_type == "TRT_FP4DynamicQuantize"]
            weight_dq = [
                n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in {w.name for w in weights}
            ]
            for n in weight_dq:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                scale = producers.get(n.input[1])
                block = inits.get(scale.input[0]) if scale is not None and scale.op_type == "DequantizeLinear" else None
                w = inits[n.input[0]]
                if (
                    attrs.get("block_size") != NVFP4_BLOCK
                    or attrs.get("axis") != -1
                    or block is None
                    or block.data_type != TensorProto.FLOAT8E4M3FN
                    or list(block.dims) != [w.dims[0], w.dims[1] // NVFP4_BLOCK]
                ):
                    raise LoopspecError(
                        f"{engine}: float4 weight {w.name} is not dequantized by float8 block scales "
                        f"[out, in/16] with block_size 16"
                    )
        if not weights or len(weight_dq) != len(weights) or not quantize:
            raise LoopspecError(
                f"{engine}: expected quantized weights behind DequantizeLinear and quantized "
                f"activations (found {len(weights)} weights, {len(weight_dq)} weight DQ, "
                f"{len(quantize)} activation quantizers)"
            )
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
