"""TensorRT backend of the Engine protocol: the four engines' plans on an NVIDIA GPU.

Caches and calls live in runtime/artifact_engine.py (shared with ONNX Runtime); here the caches sit
on the GPU as static CUDA buffers, and the valid prefix passed to each plan is copied device to
device. Every call binds its input shapes from the tensors it passes
(rows, tokens, past width), inside the plan's one optimization profile.

Inputs and outputs are bound by the names their EngineSpec declares. Results follow the torch
engine's contract: logits, drafts and log-probs come back on the CPU, taps and hidden states stay on
the GPU. tensorrt is imported lazily: without it, or without a GPU, a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loopspec.engines.manifest import Manifest
from loopspec.engines.specs import EngineSpec
from loopspec.engines.trt import check_precision_supported, cuda_capability, require_tensorrt, torch_dtype
from loopspec.errors import LoopspecError
from loopspec.runtime.artifact_engine import ArtifactEngine


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
            raise LoopspecError(f"{where} holds {manifest.stage} artifacts, not TensorRT plans "
                                "(build them with: loopspec convert trt --onnx DIR --out DIR)")
        check_precision_supported(manifest.precision, self.capability, self.device_name)
        built = manifest.data.get("settings", {}).get("compute_capability")
        here = f"{self.capability[0]}.{self.capability[1]}"
        if built is not None and built != here:
            raise LoopspecError(f"{where} was built for compute capability {built}; {self.device_name} is {here}: "
                                "rebuild the plans on this GPU")

    def _open(self, path: Path, spec: EngineSpec) -> Plan:
        return Plan(self.trt, self.runtime, path, spec, self.device)

    def _dtype(self, engine: str, tensor: str) -> torch.dtype:
        return self.runners[engine].dtypes[tensor]
