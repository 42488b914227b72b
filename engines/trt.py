"""TensorRT pieces shared by the plan builder (convert/trt.py) and the runtime backend
(runtime/trt_engine.py): the lazy import, the GPU check, which precision needs which GPU, and the
optimization profile taken from an engine spec.

tensorrt is an optional GPU-side dependency (`pip install tensorrt`), imported only here, inside
functions. Facts relied on (TensorRT documentation: Python API, "Strongly Typed Networks", the 10.x →
11.x migration guide, hardware support matrix): `NetworkDefinitionCreationFlag.STRONGLY_TYPED` is
honoured by 10.x and accepted-but-implied by 11.x (strong typing became the only mode); FP8 kernels
need compute capability 8.9 (Ada, Hopper) or newer; FP4 (NVFP4) kernels need Blackwell, compute
capability 10.0 or newer; BF16 needs 8.0 (Ampere) or newer.
"""

from __future__ import annotations

from loopspec.engines.specs import EngineSpec
from loopspec.precisions import REGISTRY, precision_names
from loopspec.errors import LoopspecError



def plan_arithmetic(precision: str) -> dict:
    """What a plan of `precision` computes with, recorded in its manifest (settings.arithmetic) and read
    back by the runtime (runtime/artifact_engine.py, `chains_only`).

    fp32 plans clear TensorRT's TF32 builder flag (it is on by default, and TF32 GEMMs round their
    inputs to 10 mantissa bits), so an fp32 plan really computes in fp32. Only those are order-exact
    the way the torch fp32 engine is: in fp16/bf16/fp8/nvfp4 a draft-tree node (whose attention sums
    masked siblings between its ancestors) rounds differently from the same token decoded plainly,
    and a few low bits turn into another greedy token; such plans verify chains only, as the int8
    CPU engines exported before the order-free softmax do."""
    plan_precision(precision)
    exact = REGISTRY[precision].order_exact
    return {"activations": precision, "tf32": False if precision == "fp32" else None, "order_exact": exact}


def plan_precision(precision: str) -> None:
    """Refuse a precision that has no TensorRT plan (loopspec/precisions.py)."""
    if precision not in precision_names(trt=True):
        raise LoopspecError(f"unknown engine precision {precision!r} (known: {', '.join(precision_names(trt=True))})")


def builder_flags(trt, precision: str) -> tuple[list, list]:
    """(flags to set, flags to clear) on a builder config for `precision` (see plan_arithmetic): a
    strongly typed network takes its precisions from the graph, so only TF32 is left to decide."""
    arithmetic = plan_arithmetic(precision)
    clear = [trt.BuilderFlag.TF32] if arithmetic["tf32"] is False else []
    return [], clear


def require_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise LoopspecError("TensorRT is not installed: pip install tensorrt (on a machine with an NVIDIA GPU)") from None
    return tensorrt


def cuda_capability() -> tuple[tuple[int, int], str]:
    """(compute capability, device name) of the current CUDA device; a clear error without one."""
    import torch

    if not torch.cuda.is_available():
        raise LoopspecError("TensorRT needs an NVIDIA GPU, and torch sees none "
                            f"(this torch: {torch.__version__})")
    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()


def check_precision_supported(precision: str, capability: tuple[int, int], device: str = "this GPU") -> None:
    """Refuse a precision whose kernels this GPU lacks (e.g. NVFP4 without Blackwell)."""
    if precision.startswith("gguf-"):
        raise LoopspecError(f"{precision} engines compute with ONNX Runtime's com.microsoft MatMulNBits, which "
                            f"TensorRT does not run: use them with --backend onnxruntime")
    plan_precision(precision)
    need = REGISTRY[precision].min_capability
    if tuple(capability) < need:
        what = REGISTRY[precision].gpu_needed or f"compute capability {need[0]}.{need[1]}"
        raise LoopspecError(f"{precision} engines need {what} (compute capability >= {need[0]}.{need[1]}); "
                            f"{device} has {capability[0]}.{capability[1]}")


def profile_shapes(spec: EngineSpec) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """One optimization profile from the spec's ranges: (input, min, opt, max) per input.

    A range may start at 0 (the first prefill has no past K/V): TensorRT supports empty tensors."""
    return [(name, lo, opt, hi) for name, (lo, opt, hi) in spec.profile_shapes().items()]


def torch_dtype(trt, dtype):
    """The torch dtype of a TensorRT I/O tensor type."""
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int64: torch.int64, trt.int8: torch.int8, trt.bool: torch.bool}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    if dtype not in table:
        raise LoopspecError(f"TensorRT I/O type {dtype} has no torch equivalent here")
    return table[dtype]
