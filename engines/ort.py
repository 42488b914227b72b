"""ONNX Runtime sessions over exported engines, bound by the names their specs declare.

Shared by the runtime backend (runtime/ort_engine.py) and the validator (convert/validate.py).
onnxruntime is imported lazily: it is the optional `onnx` extra.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loopspec.engines.specs import EngineSpec
from loopspec.errors import LoopspecError
from loopspec.precisions import precision_names

# the precisions whose graphs ONNX Runtime runs on this machine's CPU (loopspec/precisions.py): fp32,
# fp8 as standard QuantizeLinear/DequantizeLinear with float8e4m3fn (opset 19), the GGUF's blocks as
# com.microsoft MatMulNBits. NVFP4 graphs hold TensorRT's FP4 ops and float4 weights: Blackwell only.
ORT_PRECISIONS = precision_names(backend="onnxruntime")
NVFP4_NOT_HERE = "NVFP4 numerics need a Blackwell GPU (TensorRT); not run here"


def require_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise LoopspecError("the onnxruntime backend needs onnxruntime: pip install 'loopspec[onnx]'") from None
    return onnxruntime


def check_precision(precision: str, where: str) -> None:
    if precision == "nvfp4":
        raise LoopspecError(f"{where}: {NVFP4_NOT_HERE}")
    if precision not in ORT_PRECISIONS:
        raise LoopspecError(f"{where}: precision {precision!r} cannot run on ONNX Runtime on this CPU "
                            f"(supported: {', '.join(ORT_PRECISIONS)}); other precisions need TensorRT on a GPU "
                            f"with those formats")


class EngineSession:
    """One engine's InferenceSession; `run(**inputs)` → {output name: array} in spec order."""

    def __init__(self, path: str | Path, spec: EngineSpec, num_threads: int | None = None):
        ort = require_onnxruntime()
        import torch

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # the same threads as the torch backend: a fair comparison and no oversubscription
        options.intra_op_num_threads = num_threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        # no busy-waiting between calls: the decode loop alternates ORT runs with small torch ops on the
        # same cores, and spinning ORT threads starve them (measured on 2 cores, default pair: ORT `ar`
        # 39.5 → 54.1 tok/s, `dflash` 17.6 → 46.3, against 44.8 / 43.1 on the torch backend)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # errors only
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidProtobuf/... types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LoopspecError(f"cannot load ONNX engine {path}: {first}") from None
        self.spec = spec
        have_in = [i.name for i in self.session.get_inputs()]
        have_out = [o.name for o in self.session.get_outputs()]
        if sorted(have_in) != sorted(spec.input_names) or sorted(have_out) != sorted(spec.output_names):
            raise LoopspecError(f"ONNX engine {path} does not match its spec {spec.name}: inputs {have_in}, "
                                f"outputs {have_out} (expected {spec.input_names} → {spec.output_names})")

    def run(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        outputs = self.session.run(self.spec.output_names, inputs)
        return dict(zip(self.spec.output_names, outputs))
