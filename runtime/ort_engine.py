"""ONNX Runtime backend of the Engine protocol: the four exported engines on the CPU.

Caches and calls live in runtime/artifact_engine.py; this backend opens one InferenceSession per
engine. Tensors cross into ONNX Runtime as numpy arrays of CPU tensors (a copy only where a cache
prefix is not contiguous) and come back as torch views of the arrays it returns.
"""

from __future__ import annotations

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


class OrtEngine(ArtifactEngine):
    backend = "onnxruntime"

    def __init__(self, onnx_dir: str | Path, max_context: int | None = None, num_threads: int | None = None,
                 max_rows: int = 1):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.num_threads = num_threads
        super().__init__(onnx_dir, max_context, max_rows)
        self.onnx_dir = self.artifact_dir

    def _check(self, manifest: Manifest) -> None:
        check_precision(manifest.precision, str(self.artifact_dir))

    def _open(self, path: Path, spec: EngineSpec) -> OrtRunner:
        return OrtRunner(EngineSession(path, spec, self.num_threads))
