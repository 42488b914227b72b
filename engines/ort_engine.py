"""ONNX Runtime backend of the Engine protocol: an artifact's exported graphs on the CPU.

Caches and calls live in engines/artifact_engine.py; this backend opens one InferenceSession per
graph (`EngineSession`, bound by the names the specs declare). Tensors cross into ONNX Runtime as
numpy arrays of CPU tensors (a copy only where a cache prefix is not contiguous) and come back as
torch views of the arrays it returns. onnxruntime is imported lazily: it is the optional `onnx` extra.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from loopspec.engines.artifact_engine import ArtifactEngine
from loopspec.engines.manifest import Manifest
from loopspec.engines.specs import EngineSpec, present_of
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
        raise LoopspecError(
            f"{where}: precision {precision!r} cannot run on ONNX Runtime on this CPU "
            f"(supported: {', '.join(ORT_PRECISIONS)}); other precisions need TensorRT on a GPU "
            f"with those formats"
        )


class EngineSession:
    """One engine's InferenceSession; `run(**inputs)` → {output name: array} in spec order."""

    def __init__(self, path: str | Path, spec: EngineSpec, num_threads: int | None = None):
        ort = require_onnxruntime()
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
            raise LoopspecError(
                f"ONNX engine {path} does not match its spec {spec.name}: inputs {have_in}, "
                f"outputs {have_out} (expected {spec.input_names} → {spec.output_names})"
            )

    def run(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        outputs = self.session.run(self.spec.output_names, inputs)
        return dict(zip(self.spec.output_names, outputs))


class OrtRunner:
    """An EngineSession that takes and returns torch tensors. An output its spec declares as an input
    with the call's writes in it (`present_of`) is bound to that input's own memory: the graph then
    writes into it where it would have copied it first (the target's past, written by a scatter, is
    the cache itself when the call's rows lead it: 60 copies of the past a step saved)."""

    def __init__(self, session: EngineSession):
        self.session = session
        spec = session.spec
        self.in_place = {
            present_of(name): name
            for name in spec.input_names
            if present_of(name) != name and present_of(name) in spec.output_names
        }  # output → the input it writes into

    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        arrays = {name: np.ascontiguousarray(t.numpy()) for name, t in inputs.items()}  # no copy when contiguous
        if not self.in_place:
            return {name: torch.from_numpy(a) for name, a in self.session.run(**arrays).items()}
        binding = self.session.session.io_binding()
        for name, array in arrays.items():
            binding.bind_cpu_input(name, array)
        names = self.session.spec.output_names
        for name in names:
            source = arrays.get(self.in_place.get(name))
            if source is None:
                binding.bind_output(name)
            else:
                binding.bind_output(name, "cpu", 0, source.dtype, list(source.shape), source.ctypes.data)
        self.session.session.run_with_iobinding(binding)
        return {
            name: (
                torch.from_numpy(arrays[self.in_place[name]])
                if name in self.in_place
                else torch.from_numpy(value.numpy())
            )
            for name, value in zip(names, binding.get_outputs())
        }


@functools.cache
def value_product_block(head_dim: int, largest: int = 8192) -> int:
    """The block in which ONNX Runtime's fp32 MatMul sums the reduction of an attention value product
    [rows, slots] @ [slots, head_dim] on this CPU, measured: the smallest power of two B such that
    moving the same terms from before slot B to after it (zeros in between) changes the result
    (each block is summed on its own, then added), or 0 when none up to `largest` does. Measured,
    not assumed: MLAS picks the block from the product's shape (256 at head dim 64, on AVX2)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["p", "v"], ["y"])],
        "value_product",
        [
            helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, None, None]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, None, head_dim]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, head_dim])],
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )
    rng = np.random.default_rng(0)
    block, terms, shift = 16, 12, 8
    while block <= largest:
        p = rng.random((1, 6, block + terms), dtype=np.float32)
        v = rng.standard_normal((1, block + terms, head_dim), dtype=np.float32)
        # the last `terms` + `shift` slots start just before the block boundary: moved past it
        start = block - terms // 2
        p_moved = np.concatenate([p[:, :, :start], np.zeros((1, 6, shift), np.float32), p[:, :, start:]], axis=2)
        v_moved = np.concatenate(
            [v[:, :start], rng.standard_normal((1, shift, head_dim), dtype=np.float32), v[:, start:]], axis=1
        )
        if not np.array_equal(
            session.run(None, {"p": p, "v": v})[0], session.run(None, {"p": p_moved, "v": v_moved})[0]
        ):
            return block
        block *= 2
    return 0


class OrtEngine(ArtifactEngine):
    backend = "onnxruntime"

    def __init__(
        self, onnx_dir: str | Path, max_context: int | None = None, num_threads: int | None = None, max_rows: int = 1
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.num_threads = num_threads
        super().__init__(onnx_dir, max_context, max_rows)
        self.onnx_dir = self.artifact_dir

        self.tree_span = value_product_block(self.target_cfg.head_dim)

    def _check(self, manifest: Manifest) -> None:
        check_precision(manifest.precision, str(self.artifact_dir))

    def _open(self, path: Path, spec: EngineSpec) -> OrtRunner:
        return OrtRunner(EngineSession(path, spec, self.num_threads))
