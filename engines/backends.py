"""Where every engine is made: one record per backend and the openers the rest of loopspec calls.

Outside this package an engine is an `Engine` (engines/protocol.py) and comes from here: a pair's
weights on PyTorch (`torch_engine`), an artifact directory on ONNX Runtime or TensorRT
(`artifact_engine`), or the pair exported once into the cache and run on ONNX Runtime
(`cached_onnx_engine`). A new backend is a module beside the others plus one row of `BACKENDS`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from loopspec.engines.protocol import Engine
from loopspec.errors import LoopspecError


@dataclass(frozen=True)
class Backend:
    name: str
    device: str  # where it computes here: "cpu", "cuda", or "cpu or cuda"
    from_weights: bool  # runs a pair's weights as they load (torch), else an artifact directory
    artifacts: str  # what its artifact directory holds ("" for none): named in errors and docs
    extra: str  # the pip extra it needs ("" for none)


BACKENDS = {
    "torch": Backend("torch", "cpu or cuda", True, "", ""),
    "onnxruntime": Backend("onnxruntime", "cpu", False, "ONNX graphs (`loopspec convert onnx`)", "onnx"),
    "tensorrt": Backend("tensorrt", "cuda", False, "TensorRT plans (`loopspec convert trt`)", "tensorrt"),
}


def torch_engine(
    target,
    drafter,
    max_context: int | None = None,
    num_threads: int | None = None,
    cuda_graphs: bool = False,
    max_rows: int = 1,
) -> Engine:
    """The pair's modules run eagerly by PyTorch (CUDA graphs an option of it on a GPU)."""
    from loopspec.engines.torch_engine import TorchEngine

    return TorchEngine(
        target,
        drafter,
        max_context or target.cfg.max_position_embeddings,
        num_threads,
        cuda_graphs=cuda_graphs,
        max_rows=max_rows,
    )


def artifact_engine(
    backend: str, directory: str | Path, max_context: int | None = None, num_threads: int | None = None
) -> Engine:
    """The engines an artifact directory holds, on `backend` (onnxruntime or tensorrt)."""
    if backend == "onnxruntime":
        from loopspec.engines.ort_engine import OrtEngine

        return OrtEngine(directory, max_context, num_threads)
    if backend == "tensorrt":
        from loopspec.engines.trt_engine import TrtEngine

        return TrtEngine(directory, max_context)
    raise LoopspecError(
        f"backend {backend!r} runs no artifact directory "
        f"(choose from {', '.join(n for n, b in BACKENDS.items() if not b.from_weights)})"
    )


def require_cuda(device) -> None:
    """A clear error, before anything loads, where CUDA graphs cannot run on `device`."""
    from loopspec.engines.cuda_graphs import require_cuda as check

    check(device)


def export_pair(target, drafter, out_dir: str | Path, **options):
    """engines/export.py `export_engines`, with an EAGLE-3 drafter's graphs (engines/eagle3_export.py)."""
    from loopspec.engines.export import export_engines

    if drafter is not None and drafter.cfg.kind.chain:
        from loopspec.engines.eagle3_export import eagle3_engines

        options["chain_graphs"] = eagle3_engines
    return export_engines(target, drafter, out_dir, **options)


def cached_onnx_engine(
    model,
    draft_model,
    target_dir: Path,
    drafter_dir: Path | None,
    max_context: int | None,
    num_threads: int | None,
    precision: str = "fp32",
    gguf_path: Path | None = None,
) -> Engine:
    """ONNX Runtime over the pair's export in `precision`, kept in the cache: exported on first use
    (and again when the cached files no longer match their manifest). A gguf-* precision reads the
    blocks of `gguf_path` (the target's GGUF)."""
    from loopspec.engines import gguf_export
    from loopspec.engines.export import OPSET, source_key
    from loopspec.engines.ort_engine import OrtEngine
    from loopspec.files import cache_root, file_sha256

    settings = {"opset": OPSET}
    if precision != "fp32":  # the block modules are export code too
        if gguf_path is None:
            raise LoopspecError(f"precision {precision} reads the target's GGUF blocks, and this target has no GGUF")
        # the file whose blocks the graphs hold (two files of one model may share an expansion's sample)
        settings |= {
            "precision": precision,
            "gguf_export": file_sha256(Path(gguf_export.__file__)),
            "gguf_file": file_sha256(gguf_path),
        }
    if draft_model is not None and draft_model.cfg.kind.chain:  # its graphs' own code
        from loopspec.engines.eagle3_export import eagle3_code_sha256

        settings["eagle3_export"] = eagle3_code_sha256()
    onnx_dir = cache_root() / "onnx" / source_key(target_dir, draft_model, drafter_dir, settings)
    if (onnx_dir / "manifest.json").is_file():
        try:
            return OrtEngine(onnx_dir, max_context, num_threads)
        except LoopspecError as e:
            print(f"[loopspec] cached ONNX engines unusable ({e}); exporting again", file=sys.stderr)
    print(f"[loopspec] exporting {precision} ONNX engines to {onnx_dir} (once)", file=sys.stderr)
    export_pair(
        model,
        draft_model,
        onnx_dir,
        target_dir=target_dir,
        drafter_dir=drafter_dir,
        **gguf_export.precision_options(model, precision, gguf_path, draft_model),
    )
    return OrtEngine(onnx_dir, max_context, num_threads)
