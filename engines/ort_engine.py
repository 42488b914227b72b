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
from loopspec.engines.specs import TARGET_STEP, EngineSpec, present_of, step_spec
from loopspec.engines.target_step import gqa_lengths, with_rows
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

    def __init__(
        self,
        path: str | Path | bytes,
        spec: EngineSpec,
        num_threads: int | None = None,
        weights_dir: Path | None = None,
        spin: bool = False,
    ):
        """`path`: the graph's file, or the graph itself (bytes) whose external weights lie in `weights_dir`.
        `spin`: its pool's threads busy-wait between the graph's ops (see below)."""
        ort = require_onnxruntime()
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # the same threads as the torch backend: a fair comparison and no oversubscription
        options.intra_op_num_threads = num_threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        # no busy-waiting between calls: the decode loop alternates ORT runs with small torch ops on the
        # same cores, and spinning ORT threads starve them (measured on 2 cores, default pair: ORT `ar`
        # 39.5 → 54.1 tok/s, `dflash` 17.6 → 46.3, against 44.8 / 43.1 on the torch backend). A graph of
        # a few hundred small fused ops (the target's step graph) waits on its pool between every two:
        # there a sleeping pool costs more than the spinning one takes (`spin`, StepSessions: its session
        # 19.5 → 14.3 ms at 2 tokens, 256 positions, 2-core Intel Xeon with AMX). The drafter's sessions
        # do not spin: spinning beside the target's, they doubled the target's verification time there
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        options.log_severity_level = 3  # errors only
        if weights_dir is not None:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
        where = path if isinstance(path, bytes) else str(path)
        if isinstance(path, bytes):
            path = f"{spec.name} (in {weights_dir})"
        try:
            self.session = ort.InferenceSession(where, options, providers=["CPUExecutionProvider"])
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


class StepSessions:
    """The target's step graph (engines/target_step.py) over the cache's own buffers: one session per
    row count, opened on first use from the exported one-row graph (`with_rows`; the weights stay in
    the artifact's file, read by each session). Each row's past is bound as both the GroupQueryAttention
    input and its output, so the graph writes the new K/V into the cache itself; a binding is kept
    while the cache's buffers stay where they are."""

    def __init__(self, manifest: Manifest, target_cfg, num_threads: int | None):
        import onnx

        self.path = manifest.path(TARGET_STEP)
        self.template = onnx.load(str(self.path), load_external_data=False)
        taps = [t for t in manifest.spec(TARGET_STEP).outputs if t.name == "taps"]
        self.num_taps = taps[0].dims[-1] // target_cfg.hidden_size if taps else 0
        self.cfg, self.num_threads = target_cfg, num_threads
        self.max_context = manifest.spec(TARGET_STEP).ranges["tokens"][2]
        self.sessions: dict[int, object] = {}
        self.bindings: dict[tuple, object] = {}

    def session(self, rows: int):
        if rows not in self.sessions:
            spec = step_spec(self.cfg, self.num_taps, rows, self.max_context)
            model = with_rows(self.template, self.cfg, self.num_taps, rows, self.max_context)
            session = EngineSession(model.SerializeToString(), spec, self.num_threads, self.path.parent, spin=True)
            self.sessions[rows] = session.session
        return self.sessions[rows]

    def run(self, cache, first: int, ids: np.ndarray, logit_index: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows first.. of `cache` run `ids` [R, W] after their lengths; the new K/V land in the cache."""
        rows, width = ids.shape
        starts = cache.lengths[first : first + rows].numpy()
        key = (rows, first, cache.k.data_ptr(), cache.v.data_ptr(), cache.slots)
        binding = self.bindings.get(key)
        outputs = ["logits"] + (["taps"] if self.num_taps else [])
        if binding is None:
            self.bindings = {k: b for k, b in self.bindings.items() if k[:2] != key[:2]}  # buffers moved
            binding = self.bindings[key] = self.session(rows).io_binding()
            for name in outputs:  # first: get_outputs() lists them where they were first bound
                binding.bind_output(name)
            for layer in range(self.cfg.num_layers):
                for row in range(rows):
                    for kind, buffer in (("key", cache.k), ("value", cache.v)):
                        past = buffer[layer, first + row].numpy()[None]  # [1, kvh, slots, hd]: the cache itself
                        for name in (f"past_{kind}", f"present_{kind}"):
                            bind = binding.bind_input if name.startswith("past") else binding.bind_output
                            bind(f"{name}_{layer}_{row}", "cpu", 0, np.float32, list(past.shape), past.ctypes.data)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("logit_index", logit_index)
        seqlens, total = gqa_lengths(starts, width)
        binding.bind_cpu_input("seqlens_k", seqlens)
        binding.bind_cpu_input("total_sequence_length", total)
        for name in outputs:  # fresh arrays: the caller keeps what a call returned
            binding.bind_output(name)
        self.sessions[rows].run_with_iobinding(binding)
        return {name: torch.from_numpy(value.numpy()) for name, value in zip(outputs, binding.get_outputs())}


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

    def _open_step(self, manifest: Manifest) -> StepSessions | None:
        if TARGET_STEP not in manifest.engines:
            return None
        return StepSessions(manifest, self.target_cfg, self.num_threads)
