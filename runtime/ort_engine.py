"""ONNX Runtime backend of the Engine protocol: the four exported engines on the CPU.

Caches and calls live in runtime/artifact_engine.py; this backend opens one InferenceSession per
engine. Tensors cross into ONNX Runtime as numpy arrays of CPU tensors (a copy only where a cache
prefix is not contiguous) and come back as torch views of the arrays it returns.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from loopspec.engines.manifest import Manifest
from loopspec.engines.ort import EngineSession, check_precision
from loopspec.engines.specs import EngineSpec
from loopspec.runtime.artifact_engine import ArtifactEngine


class OrtRunner:
    """An EngineSession that takes and returns torch tensors."""

    def __init__(self, session: EngineSession):
        self.session = session

    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        arrays = {name: np.ascontiguousarray(t.numpy()) for name, t in inputs.items()}
        return {name: torch.from_numpy(a) for name, a in self.session.run(**arrays).items()}


@functools.cache
def value_product_block(head_dim: int, largest: int = 8192) -> int:
    """The block in which ONNX Runtime's fp32 MatMul sums the reduction of an attention value product
    [rows, slots] @ [slots, head_dim] on this CPU, measured: the smallest power of two B such that
    moving the same terms from before slot B to after it (zeros in between) changes the result
    (each block is summed on its own, then added), or 0 when none up to `largest` does. Measured,
    not assumed: MLAS picks the block from the product's shape (256 at head dim 64, on AVX2)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MatMul", ["p", "v"], ["y"])], "value_product",
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, None, None]),
                               helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, None, head_dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, head_dim])])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                                   options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    block, terms, shift = 16, 12, 8
    while block <= largest:
        p = rng.random((1, 6, block + terms), dtype=np.float32)
        v = rng.standard_normal((1, block + terms, head_dim), dtype=np.float32)
        # the last `terms` + `shift` slots start just before the block boundary: moved past it
        start = block - terms // 2
        p_moved = np.concatenate([p[:, :, :start], np.zeros((1, 6, shift), np.float32), p[:, :, start:]], axis=2)
        v_moved = np.concatenate([v[:, :start], rng.standard_normal((1, shift, head_dim), dtype=np.float32), v[:, start:]], axis=1)
        if not np.array_equal(session.run(None, {"p": p, "v": v})[0], session.run(None, {"p": p_moved, "v": v_moved})[0]):
            return block
        block *= 2
    return 0


class OrtEngine(ArtifactEngine):
    backend = "onnxruntime"

    def __init__(self, onnx_dir: str | Path, max_context: int | None = None, num_threads: int | None = None,
                 max_rows: int = 1):
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
