"""Files every layer reads and writes — safetensors, JSON configs, content hashes, the cache
folder — with their failures as one clear line. No model code: the models import these too."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from loopspec.errors import LoopspecError


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loopspec"


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
    if quant:
        algo = quant.get("quant_algo", "quantized") if isinstance(quant, dict) else "quantized"
        raise LoopspecError(f"{directory} is a {algo} checkpoint for TensorRT-LLM / vLLM / SGLang; here run its "
                            f"exported engines (--backend onnxruntime --onnx-dir) or the unquantized checkpoint")




def one_line(error: Exception) -> str:
    """A library's multi-line message as one line: its first substantive line and how many follow
    (torch's load_state_dict lists every mismatched tensor; a CLI error is one line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    detail = next((line for line in lines[1:] if "mismatch" in line or "Missing" in line or "Unexpected" in line),
                  None)
    text = lines[0].rstrip(":") + (f": {detail}" if detail else "")
    rest = len(lines) - (2 if detail else 1)
    return text + (f" (and {rest} more lines)" if rest > 0 else "")
