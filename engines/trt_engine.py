"""TensorRT backend of the Engine protocol: the four engines' plans on an NVIDIA GPU, and the pieces
the plan builder (convert/trt.py) shares with it: the lazy import, the GPU check, which precision
needs which GPU, what a plan computes with, and the optimization profile taken from an engine spec.

Caches and calls live in engines/artifact_engine.py (shared with ONNX Runtime); here the caches sit
on the GPU as static CUDA buffers, and the valid prefix passed to each plan is copied device to
device. Every call binds its input shapes from the tensors it passes (rows, tokens, past width),
inside the plan's one optimization profile. Inputs and outputs are bound by the names their
EngineSpec declares. Results follow the torch engine's contract: logits, drafts and log-probs come
back on the CPU, taps and hidden states stay on the GPU.

tensorrt is an optional GPU-side dependency (`pip install tensorrt`), imported only inside
functions: without it, or without a GPU, a clear error. Facts relied on (TensorRT documentation:
Python API, "Strongly Typed Networks", the 10.x → 11.x migration guide, hardware support matrix):
`NetworkDefinitionCreationFlag.STRONGLY_TYPED` is honoured by 10.x and accepted-but-implied by 11.x
(strong typing became the only mode); FP8 kernels need compute capability 8.9 (Ada, Hopper) or
newer; FP4 (NVFP4) kernels need Blackwell, compute capability 10.0 or newer; BF16 needs 8.0
(Ampere) or newer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loopspec.engines.artifact_engine import ArtifactEngine
from loopspec.engines.manifest import Manifest
from loopspec.engines.specs import EngineSpec
from loopspec.errors import LoopspecError
from loopspec.precisions import REGISTRY, precision_names


def plan_arithmetic(precision: str) -> dict:
    """What a plan of `precision` computes with, recorded in its manifest (settings.arithmetic) and read
    back by the runtime (engines/artifact_engine.py, `chains_only`).

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
        raise LoopspecError(
            "TensorRT is not installed: pip install tensorrt (on a machine with an NVIDIA GPU)"
        ) from None
    return tensorrt


def cuda_capability() -> tuple[tuple[int, int], str]:
    """(compute capability, device name) of the current CUDA device; a clear error without one."""
    if not torch.cuda.is_available():
        raise LoopspecError(f"TensorRT needs an NVIDIA GPU, and torch sees none (this torch: {torch.__version__})")
    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()


def check_precision_supported(precision: str, capability: tuple[int, int], device: str = "this GPU") -> None:
    """Refuse a precision whose kernels this GPU lacks (e.g. NVFP4 without Blackwell)."""
    if precision.startswith("gguf-"):
        raise LoopspecError(
            f"{precision} engines compute with ONNX Runtime's com.microsoft MatMulNBits, which "
            f"TensorRT does not run: use them with --backend onnxruntime"
        )
    plan_precision(precision)
    need = REGISTRY[precision].min_capability
    if tuple(capability) < need:
        what = REGISTRY[precision].gpu_needed or f"compute capability {need[0]}.{need[1]}"
        raise LoopspecError(
            f"{precision} engines need {what} (compute capability >= {need[0]}.{need[1]}); "
            f"{device} has {capability[0]}.{capability[1]}"
        )


def profile_shapes(spec: EngineSpec) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """One optimization profile from the spec's ranges: (input, min, opt, max) per input.

    A range may start at 0 (the first prefill has no past K/V): TensorRT supports empty tensors."""
    return [(name, lo, opt, hi) for name, (lo, opt, hi) in spec.profile_shapes().items()]


def torch_dtype(trt, dtype):
    """The torch dtype of a TensorRT I/O tensor type."""
    table = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.int32: torch.int32,
        trt.int64: torch.int64,
        trt.int8: torch.int8,
        trt.bool: torch.bool,
    }
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    if dtype not in table:
        raise LoopspecError(f"TensorRT I/O type {dtype} has no torch equivalent here")
    return table[dtype]


class Plan:
    """One deserialized engine and its execution context; `run(**inputs)` → {output name: tensor}."""

    def __init__(self, trt, runtime, path: Path, spec: EngineSpec, device: torch.device):
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise LoopspecError(f"TensorRT cannot load the plan {path} (built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.spec, self.device = spec, device
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        if sorted(names) != sorted(spec.input_names + spec.output_names):
            raise LoopspecError(f"plan {path} does not match its spec {spec.name}: tensors {names}")
        self.dtypes = {n: torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.empty = torch.zeros(1, device=device)  # an address for zero-size tensors (the first past)

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        self.context.set_tensor_address(name, tensor.data_ptr() if tensor.numel() else self.empty.data_ptr())

    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        keep = []  # the bound inputs must live until the plan has run
        for name in self.spec.input_names:
            t = inputs[name]
            self.spec.check_input(name, tuple(t.shape))
            t = t.to(self.device, self.dtypes[name]).contiguous()
            keep.append(t)
            self.context.set_input_shape(name, tuple(t.shape))
            self._bind(name, t)
        outputs = {}
        for name in self.spec.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise LoopspecError(f"engine {self.spec.name}: output {name} has an undetermined shape {shape}")
            outputs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
            self._bind(name, outputs[name])
        if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise LoopspecError(f"TensorRT failed to run {self.spec.name}")
        return outputs


class TrtEngine(ArtifactEngine):
    backend = "tensorrt"

    def __init__(self, plan_dir: str | Path, max_context: int | None = None, max_rows: int = 1):
        self.trt = require_tensorrt()
        self.capability, self.device_name = cuda_capability()
        self.device = torch.device("cuda")
        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        super().__init__(plan_dir, max_context, max_rows)
        self.plan_dir = self.artifact_dir

    def _check(self, manifest: Manifest) -> None:
        where = self.artifact_dir
        if manifest.stage != "tensorrt":
            raise LoopspecError(
                f"{where} holds {manifest.stage} artifacts, not TensorRT plans "
                "(build them with: loopspec convert trt --onnx DIR --out DIR)"
            )
        check_precision_supported(manifest.precision, self.capability, self.device_name)
        built = manifest.data.get("settings", {}).get("compute_capability")
        here = f"{self.capability[0]}.{self.capability[1]}"
        if built is not None and built != here:
            raise LoopspecError(
                f"{where} was built for compute capability {built}; {self.device_name} is {here}: "
                "rebuild the plans on this GPU"
            )

    def _open(self, path: Path, spec: EngineSpec) -> Plan:
        return Plan(self.trt, self.runtime, path, spec, self.device)

    def _dtype(self, engine: str, tensor: str) -> torch.dtype:
        return self.runners[engine].dtypes[tensor]
