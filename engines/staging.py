"""Staged writes of an output directory: build it in a temporary sibling, then swap it into place.

Every conversion step that writes a directory (ONNX engines, quantized checkpoints, TensorRT plans,
serving bundles) writes it as

    with staged_dir(out_dir) as tmp:
        ...write everything under tmp...

Only when the block ends without an exception does `tmp` replace `out_dir`. An exception (bad input,
a failed build, Ctrl-C) removes `tmp` and leaves any previous `out_dir` exactly as it was: there is
never a half-written artifact, and a good artifact is never lost to a bad run. The temporary sibling
is `<name>.<random>.tmp` next to `out_dir` (same filesystem, so the final renames are atomic); only a
killed process (SIGKILL, power loss) can leave one behind, and it is safe to delete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loopspec.errors import LoopspecError


def check_out_dir(out_dir: str | Path, marker: str, what: str) -> Path:
    """Refuse an `out_dir` that a step must not replace: a file, or a non-empty directory without
    `marker` (so not an earlier output of that step: it may hold the user's own files). Steps call it
    before any long work, so bad input fails at once; `what` names the output ("a bundle")."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise LoopspecError(f"{out_dir} exists and is a file, not {what}; refusing to overwrite it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / marker).is_file():
        raise LoopspecError(f"{out_dir} exists and is not {what}; refusing to overwrite it")
    return out_dir


def _sibling(path: Path, suffix: str) -> Path:
    # random per write: two writes of the same directory never share a temporary
    return path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{suffix}")


def replace_dir(src: str | Path, dst: str | Path) -> Path:
    """Move the directory `src` to `dst`, replacing whatever directory is there. The old `dst` is
    renamed aside first and removed only once `src` is in place; if moving `src` fails, the old `dst`
    is put back. Both paths must be on one filesystem (siblings are)."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not dst.is_dir():
        raise LoopspecError(f"{dst} exists and is a file; refusing to replace it with a directory")
    old = None
    if dst.exists():
        old = _sibling(dst, ".old")
        dst.rename(old)
    try:
        src.rename(dst)
    except BaseException:
        if old is not None:
            old.rename(dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dst


@contextmanager
def staged_dir(out_dir: str | Path) -> Iterator[Path]:
    """A fresh temporary directory next to `out_dir` that replaces `out_dir` when the block succeeds
    and is removed when it raises (see the module doc). Its parent directories are created."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise LoopspecError(f"{out_dir} exists and is a file; refusing to replace it with a directory")
    parent = out_dir.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoopspecError(
            f"cannot create {out_dir}: cannot make its parent directory {parent} ({e.strerror or e})"
        ) from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LoopspecError(f"cannot write {out_dir}: its parent directory {parent} is not writable")
    tmp = _sibling(out_dir, ".tmp")
    try:
        tmp.mkdir()
    except OSError as e:
        raise LoopspecError(f"cannot write {out_dir}: cannot create {tmp} ({e.strerror or e})") from None
    try:
        yield tmp
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after success tmp is out_dir already: nothing to remove
