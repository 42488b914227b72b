"""Stage `convert onnx`: the target (+ drafter) → fp32 ONNX engines in one directory, validated.

The graphs are traced from the export wrappers of `loopspec.engines.export` with the TorchScript
exporter (`torch.onnx.export(dynamo=False)`, opset 17): it gives plain standard ops (Gather, MatMul,
Softmax, Where, ...) that ONNX Runtime runs, and it traces SmolLM2-135M's 30 layers ~15x faster than
the dynamo exporter, which gave the same op set here. Weights go to `<engine>.onnx.data` beside each
graph. The directory is self-contained: `target/` holds the target's config and tokenizer,
`drafter/` the drafter's config (mask token resolved) and its d2t map; the drafter_block graph
outputs target token ids.
"""

from __future__ import annotations

from pathlib import Path

from loopspec.convert.validate import validate_onnx
from loopspec.engines.export import OPSET, export_engines
from loopspec.engines.manifest import Manifest
from loopspec.model.drafter import Drafter
from loopspec.model.target import Target


def convert_onnx(target: Target, drafter: Drafter | None, out_dir: str | Path, *, target_dir: str | Path,
                 drafter_dir: str | Path | None = None, max_context: int | None = None, block_size: int | None = None,
                 validate: bool = True, num_threads: int | None = None, opset: int = OPSET) -> tuple[Manifest, dict | None]:
    """Export every engine into `out_dir` (manifest.json with provenance) and, unless `validate` is
    False, check it against the PyTorch reference (the report is stored in the manifest too)."""
    manifest = export_engines(target, drafter, out_dir, target_dir=target_dir, drafter_dir=drafter_dir,
                              max_context=max_context, block_size=block_size, opset=opset)
    report = validate_onnx(out_dir, target, drafter, "fp32", num_threads=num_threads) if validate else None
    return manifest, report
