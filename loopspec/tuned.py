"""Where a `loopspec tune` result is kept, and which one a pipeline uses.

A user's own drafter directory keeps its result in its config.json (`loopspec.tuned[engine]`), beside
the weights it was measured with. A shipped drafter lives inside the installed package, which may be
read-only (a system site-packages), so a result for it goes to a per-user store instead:
`<cache>/tuned/<drafter weights key>-<engine>.json`, where `<cache>` is loopspec's cache directory
(loopspec.weights.cache_root). That user result wins over the setting shipped in the drafter's
config.json, which stays as shipped. The key is a hash of the drafter's weights, so a result
measured with one release's drafter is not applied to another's.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.settings import KNOBS

SHIPPED_DRAFTERS = Path(__file__).resolve().parent / "drafters"
STORED = tuple(name for name, knob in KNOBS.items() if knob.tuned)  # the knobs a tune result sets


def is_shipped(drafter_dir: str | Path) -> bool:
    """Whether the drafter directory is one this package ships (and so may not be writable)."""
    return Path(drafter_dir).resolve().is_relative_to(SHIPPED_DRAFTERS)


def weights_key(drafter_dir: str | Path) -> str:
    """A short content hash of the drafter's weights files (names and the first 16 MiB of each:
    cheap enough to compute whenever settings are resolved, and it changes with the weights)."""
    from loopspec.weights import file_sha256

    h = hashlib.sha256()
    for f in sorted(Path(drafter_dir).glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(file_sha256(f, limit_bytes=16 << 20).encode())
    return h.hexdigest()[:16]


def user_store_path(drafter_dir: str | Path, engine: str, store: Path | None = None) -> Path:
    """The per-user file of a shipped drafter's tuned setting on `engine` (an engine key such as
    "onnxruntime gguf-int8act"; the space becomes a dash in the file name). `store`: the folder
    (default: the `tuned` folder of loopspec's cache directory)."""
    if store is None:
        from loopspec.weights import cache_root

        store = cache_root() / "tuned"
    return Path(store) / f"{weights_key(drafter_dir)}-{engine.replace(' ', '-')}.json"


def user_setting(drafter_dir: str | Path | None, engine: str, store: Path | None = None) -> dict | None:
    """The user's tuned setting of a shipped drafter on `engine`, or None (not shipped, none stored,
    or a file that cannot be read as one: then the shipped setting applies)."""
    if drafter_dir is None or not is_shipped(drafter_dir):
        return None
    path = user_store_path(drafter_dir, engine, store)
    try:
        setting = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return {k: setting[k] for k in STORED if k in setting} if isinstance(setting, dict) else None


def store_setting(drafter_dir: str | Path, setting: dict, engine: str, store: Path | None = None) -> Path:
    """Write the chosen setting (block size, stages, gate, tree budget, suffix, suffix-first: what dflash and
    dloop resolve to by default) where it will be found again; returns the file written.

    A shipped drafter: the per-user file (`user_store_path`). A user's drafter directory: its
    config.json under loopspec.tuned[engine], the engine it was measured on
    (loopspec.settings.engine_key); the first one stored there is also loopspec.dloop, the
    drafter's setting for the engines not tuned yet. Either file is replaced whole (written
    beside it, then renamed), so an interrupted store leaves the old one intact."""
    chosen = {k: setting[k] for k in STORED if k in setting}
    if is_shipped(drafter_dir):
        path = user_store_path(drafter_dir, engine, store)
        path.parent.mkdir(parents=True, exist_ok=True)
        _replace(path, json.dumps(chosen, indent=2) + "\n")
        return path
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise LoopspecError(f"cannot store the tuned setting: {path} does not exist")
    cfg = json.loads(path.read_text())
    extra = cfg.setdefault("loopspec", {})
    extra.setdefault("tuned", {})[engine] = chosen
    extra.setdefault("dloop", chosen)
    _replace(path, json.dumps(cfg, indent=2) + "\n")
    return path


def check_storable(drafter_dir: str | Path) -> None:
    """Refuse, before a sweep, a store that would fail after it: a user's drafter directory it
    cannot write its config.json into. (The per-user store is created when written.)"""
    if is_shipped(drafter_dir) or not Path(drafter_dir).is_dir():
        return  # the per-user store is created when written; a missing drafter is the loader's to report
    path = Path(drafter_dir) / "config.json"
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise LoopspecError(
            f"cannot store the tuned setting in {path}: not writable "
            "(copy the drafter directory somewhere writable, or pass --no-store)"
        )


def _replace(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", delete=False, encoding="utf-8"
    ) as f:
        f.write(text)
    os.replace(f.name, path)
