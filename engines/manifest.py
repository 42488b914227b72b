"""`manifest.json`: what an artifact directory holds and where it came from, at every stage.

Written by each conversion stage (onnx, quantized, tensorrt, bundle): the stage, the precision, the
sha256 of the inputs it was made from, the tool versions, the engine specs as data, and the sha256 of
every artifact file. Reading verifies those hashes, so a truncated or edited file, a missing engine or
a manifest from elsewhere is a clear error instead of a wrong answer.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path

from loopspec.engines.eagle3_specs import EAGLE3_ENGINES
from loopspec.engines.specs import DRAFTER_ENGINES, TARGET_STEP, TARGET_VERIFY, EngineSpec
from loopspec.errors import LoopspecError
from loopspec.weights import file_sha256, read_json

MANIFEST = "manifest.json"
# a drafter's graphs: a block drafter's three, or an EAGLE-3 drafter's two (engines/eagle3_specs.py)
DRAFTER_GRAPH_SETS = (DRAFTER_ENGINES, EAGLE3_ENGINES)
FORMAT = "loopspec-artifacts"
FORMAT_VERSION = 1


def tool_versions(names=("torch", "onnx", "onnxruntime", "onnxscript", "loopspec")) -> dict[str, str | None]:
    """Installed versions of the tools a stage used (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def source_hashes(directory: str | Path | None, names: list[str] | None = None) -> dict | None:
    """{"path": dir, "files": {name: sha256}} over a source checkpoint's config and weight files."""
    if directory is None:
        return None
    directory = Path(directory)
    files = (
        names
        if names is not None
        else sorted(
            f.name
            for f in directory.iterdir()
            if f.is_file() and (f.suffix in (".safetensors", ".gguf") or f.name == "config.json")
        )
    )
    return {
        "path": str(directory.resolve()),
        "files": {n: file_sha256(directory / n) for n in files if (directory / n).is_file()},
    }


@dataclass
class Manifest:
    directory: Path
    data: dict

    @property
    def stage(self) -> str:
        return self.data["stage"]

    @property
    def precision(self) -> str:
        return self.data["precision"]

    @property
    def engines(self) -> list[str]:
        return list(self.data["engines"])

    @property
    def has_drafter(self) -> bool:
        return any(all(name in self.data["engines"] for name in names) for names in DRAFTER_GRAPH_SETS)

    def spec(self, engine: str) -> EngineSpec:
        if engine not in self.data["engines"]:
            raise LoopspecError(
                f"{self.directory}: no engine {engine!r} in the manifest (has {', '.join(self.engines)})"
            )
        return EngineSpec.from_dict(self.data["engines"][engine]["spec"])

    def path(self, engine: str) -> Path:
        self.spec(engine)
        return self.directory / self.data["engines"][engine]["file"]

    def save(self) -> None:
        (self.directory / MANIFEST).write_text(json.dumps(self.data, indent=2) + "\n")


def write_manifest(
    directory: str | Path,
    *,
    stage: str,
    precision: str,
    specs: dict[str, EngineSpec],
    engine_files: dict[str, str],
    sources: dict,
    settings: dict | None = None,
    tools: dict | None = None,
    parent: dict | None = None,
) -> Manifest:
    """Hash every file under `directory` (except the manifest) and write manifest.json.

    engine_files: {engine name: file name relative to directory}; sources: provenance of the inputs
    (e.g. {"target": source_hashes(dir), "drafter": ...}); parent: the manifest of the previous stage."""
    directory = Path(directory)
    files = {
        str(f.relative_to(directory)): file_sha256(f)
        for f in sorted(directory.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    for engine, name in engine_files.items():
        if name not in files:
            raise LoopspecError(f"engine {engine}: file {name} is not in {directory}")
    data = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "stage": stage,
        "precision": precision,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tools": tools if tools is not None else tool_versions(),
        "sources": sources,
        "settings": settings or {},
        "engines": {name: {"file": engine_files[name], "spec": spec.to_dict()} for name, spec in specs.items()},
        "files": files,
    }
    if parent is not None:
        data["parent"] = parent
    manifest = Manifest(directory, data)
    manifest.save()
    return manifest


def read_manifest(directory: str | Path, verify: bool = True, require_drafter: bool = False) -> Manifest:
    """Read and check an artifact directory: the manifest parses, every engine and listed file is
    there, and (verify) every file's sha256 matches. Anything else → LoopspecError."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoopspecError(f"artifact directory does not exist: {directory}")
    path = directory / MANIFEST
    data = read_json(path, f"{MANIFEST} (not an exported artifact directory)")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LoopspecError(f"{path} is not a loopspec artifact manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise LoopspecError(
            f"{path}: manifest format version {data.get('format_version')} is not supported "
            f"(this loopspec reads {FORMAT_VERSION})"
        )
    for key in ("stage", "precision", "engines", "files"):
        if key not in data:
            raise LoopspecError(f"{path} lacks {key!r}")
    manifest = Manifest(directory, data)
    engines = data["engines"]
    if TARGET_VERIFY not in engines and TARGET_STEP not in engines:
        raise LoopspecError(
            f"{directory}: missing the target's engine ({TARGET_VERIFY} or {TARGET_STEP}) in the manifest"
        )
    # the drafter's graphs are one whole set: the set any of them belongs to (the block drafter's by default)
    names = next((names for names in DRAFTER_GRAPH_SETS if any(e in engines for e in names)), DRAFTER_ENGINES)
    present = [e for e in names if e in engines]
    if (present or require_drafter) and len(present) != len(names):
        missing = [e for e in names if e not in engines]
        raise LoopspecError(f"{directory}: missing drafter engine(s) {', '.join(missing)} in the manifest")
    files = data["files"]
    for name, entry in engines.items():
        manifest.spec(name)  # malformed specs fail here
        if entry.get("file") not in files:
            raise LoopspecError(f"{directory}: engine {name} names a file the manifest does not list")
    for name, digest in files.items():
        f = directory / name
        if not f.is_file():
            raise LoopspecError(f"{directory}: missing artifact file {name} (listed in {MANIFEST})")
        if verify:
            actual = file_sha256(f)
            if actual != digest:
                raise LoopspecError(
                    f"{directory}: hash mismatch for {name} (sha256 {actual[:12]}…, manifest says "
                    f"{digest[:12]}…): the file changed after export; re-export it"
                )
    return manifest
