"""Files every layer reads and writes — safetensors, JSON configs, content hashes, the cache
folder — with their failures as one clear line. No model code: the models import these too."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import torch

from loopspec.errors import LoopspecError


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loopspec"


def sampled_sha256(path: str | Path, head_bytes: int = 16 << 20, samples: int = 64, sample_bytes: int = 1 << 16) -> str:
    """sha256 over a file's size, its first `head_bytes` and `samples` slices spread over the rest:
    cheap on a large weights file, and two files that differ anywhere in a matrix differ in it (a
    quantization changes every block of a matrix; the first 16 MiB alone hold only the embedding's
    first rows, which two files of one model can share)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    h.update(file_sha256(path, limit_bytes=head_bytes).encode())
    if size > head_bytes:
        with open(path, "rb") as f:
            for i in range(samples):
                f.seek(head_bytes + (size - head_bytes) * i // samples)
                h.update(f.read(sample_bytes))
    return h.hexdigest()


def file_sha256(path: str | Path, limit_bytes: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = limit_bytes
        while True:
            chunk = f.read(1 << 20 if remaining is None else min(1 << 20, remaining))
            if not chunk:
                break
            h.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
                if remaining <= 0:
                    break
    return h.hexdigest()


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise LoopspecError(f"corrupt or unreadable safetensors file {path}: {e}") from None


def read_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LoopspecError(f"no *.safetensors file in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors(f))
    return state


def write_safetensors(state: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata or {"format": "pt"})


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise LoopspecError(f"missing {what}: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoopspecError(f"corrupt {what} {path}: {e}") from None


def refuse_quantized(config: dict, directory: str | Path) -> None:
    """A modelopt FP8/NVFP4 checkpoint holds packed weights and scales that fp32 modules would misread."""
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":  # gpt-oss as published
        raise LoopspecError(
            f"{directory} holds MXFP4 expert weights; load it dequantized (transformers: "
            "from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)), then "
            "save_pretrained) and pass that directory"
        )
    if quant:
        algo = quant.get("quant_algo", "quantized") if isinstance(quant, dict) else "quantized"
        raise LoopspecError(
            f"{directory} is a {algo} checkpoint for TensorRT-LLM / vLLM / SGLang; here run its "
            f"exported engines (--backend onnxruntime --onnx-dir) or the unquantized checkpoint"
        )


def one_line(error: Exception) -> str:
    """A library's multi-line message as one line: its first substantive line and how many follow
    (torch's load_state_dict lists every mismatched tensor; a CLI error is one line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    detail = next((line for line in lines[1:] if "mismatch" in line or "Missing" in line or "Unexpected" in line), None)
    text = lines[0].rstrip(":") + (f": {detail}" if detail else "")
    rest = len(lines) - (2 if detail else 1)
    return text + (f" (and {rest} more lines)" if rest > 0 else "")


@contextlib.contextmanager
def output_file(path: str | Path | None, flag: str):
    """Reserve an output file for the run inside the `with`: refused in one line before any work if it
    cannot be written (a directory, a missing folder, or a place the file cannot be created: the file
    is opened for appending, which for root is the only honest check), and removed again when the run
    fails having written nothing into the file it created. None: no output."""
    if path is None:
        yield None
        return
    path = Path(path)
    if path.is_dir():
        raise LoopspecError(f"{flag} {path} is a directory, which is not a file: name the file to write")
    if not path.parent.is_dir():
        raise LoopspecError(f"{flag} {path}: the folder {path.parent} does not exist")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise LoopspecError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    try:
        yield path
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                if path.stat().st_size == 0:
                    path.unlink()
        raise


@contextlib.contextmanager
def output_dir(path: str | Path | None, flag: str):
    """Reserve an output directory for the run inside the `with`: created (with its missing parents)
    and a probe file written and removed in it before any work, refused in one line where that fails;
    the directories it created are removed again when the run fails leaving them empty (what a
    resumable run saved stays). None: no output."""
    if path is None:
        yield None
        return
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise LoopspecError(f"{flag} is not a directory: {path}")
    created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first

    def remove_empty():
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty one

    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".loopspec-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        remove_empty()
        raise LoopspecError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    try:
        yield path
    except BaseException:
        remove_empty()
        raise
