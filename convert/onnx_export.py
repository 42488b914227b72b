"""Stage `convert onnx`: the target (+ drafter) → fp32 ONNX engines in one directory, validated.

The graphs are traced from the export wrappers of `loopspec.engines.export` with the TorchScript
exporter (`torch.onnx.export(dynamo=False)`, opset 17): it gives plain standard ops (Gather, MatMul,
Softmax, Where, ...) that ONNX Runtime runs, and it traces SmolLM2-135M's 30 layers ~15x faster than
the dynamo exporter, which gave the same op set here. Weights go to `<engine>.onnx.data` beside each
graph. The directory is self-contained: `target/` holds the target's config and tokenizer,
`drafter/` the drafter's config (mask token resolved) and its d2t map; the drafter_block graph
outputs target token ids.

Precision `fp32` (default) exports the fp32 weights. `gguf-fp32act` / `gguf-int8act` export the
target_verify graph over the GGUF's own 4-bit / 8-bit blocks (engines/gguf_export.py) with fp32 or
int8 activations; with int8 activations the drafter engines compute with Q8_0 blocks of the
drafter's own weights and the GGUF's own lm_head rows (`block_drafter`), with fp32 activations they
stay fp32.
"""

from __future__ import annotations

from pathlib import Path

from loopspec.convert.validate import validate_onnx
from loopspec.engines.backends import export_pair
from loopspec.engines.export import OPSET
from loopspec.engines.gguf_export import precision_options
from loopspec.engines.manifest import Manifest
from loopspec.model.dflash import Drafter
from loopspec.model.target import Target


def convert_onnx(
    target: Target,
    drafter: Drafter | None,
    out_dir: str | Path,
    *,
    target_dir: str | Path,
    drafter_dir: str | Path | None = None,
    max_context: int | None = None,
    block_size: int | None = None,
    validate: bool = True,
    num_threads: int | None = None,
    opset: int = OPSET,
    precision: str = "fp32",
    gguf_path: str | Path | None = None,
) -> tuple[Manifest, dict | None]:
    """Export every engine into `out_dir` (manifest.json with provenance) and, unless `validate` is
    False, check it against the PyTorch reference (the report is stored in the manifest too).
    A `gguf-*` precision reads the target's blocks from `gguf_path`, the GGUF `target` was expanded from."""
    manifest = export_pair(
        target,
        drafter,
        out_dir,
        target_dir=target_dir,
        drafter_dir=drafter_dir,
        max_context=max_context,
        block_size=block_size,
        opset=opset,
        **precision_options(target, precision, gguf_path, drafter),
    )
    report = validate_onnx(out_dir, target, drafter, precision, num_threads=num_threads) if validate else None
    return manifest, report
