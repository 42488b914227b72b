"""Kept data: a data directory's samples as token ids only (no taps), xz-compressed, small enough to
keep in the repository, so that a new machine resumes `loopspec data` instead of regenerating.

Layout of a kept directory (data/smollm2-135m-instruct/ for the default target):
  manifest.json      target fingerprint, generation settings, counts, and the sha256 of samples.jsonl.xz
  samples.jsonl.xz   the lines of samples.jsonl ({"id", "file", "line", "tokens", "prompt_len", "finish"}:
                     file is the prompt file's name, line the prompt's 1-based line in it), by file and line
`loopspec data --kept DIR` copies these samples into its --out directory instead of regenerating them
(with --cache-taps it recomputes their taps by one teacher-forced target forward);
`loopspec data --pack DIR --out DATA_DIR` writes DIR from a data directory, keeping what DIR held.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from collections import Counter
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.train.samples import Sample, parse_sample, read_samples, sample_json
from loopspec.weights import read_json

KIND = "loopspec-kept-data"
SAMPLES = "samples.jsonl.xz"


def read_kept(directory: str | Path, target_hash: str, settings: dict) -> dict[str, Sample]:
    """{sample id: sample} of a kept directory made for this target with these generation settings."""
    directory = Path(directory)
    manifest_path, samples_path = directory / "manifest.json", directory / SAMPLES
    manifest = read_json(manifest_path, "manifest.json (not a kept data directory)")
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise LoopspecError(f"{manifest_path} is not a kept data manifest (kind {KIND!r})")
    if manifest.get("target_sha256") != target_hash:
        raise LoopspecError(
            f"{directory} was kept for another target (fingerprint "
            f"{str(manifest.get('target_sha256'))[:12]}…, this target's {target_hash[:12]}…)"
        )
    kept_settings = manifest.get("settings") or {}
    if kept_settings != settings:
        differ = sorted(k for k in set(kept_settings) | set(settings) if kept_settings.get(k) != settings.get(k))
        raise LoopspecError(
            f"{directory} was generated with other settings: "
            + ", ".join(f"{k} {kept_settings.get(k)!r} there, {settings.get(k)!r} here" for k in differ)
        )
    if not samples_path.is_file():
        raise LoopspecError(f"no {SAMPLES} in {directory}")
    data = samples_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest.get("samples_sha256"):
        raise LoopspecError(f"{samples_path} is corrupt (its sha256 differs from the manifest's)")
    try:
        lines = lzma.decompress(data).decode("utf-8").split("\n")
        samples = [parse_sample(line) for line in lines if line.strip()]
    except (lzma.LZMAError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise LoopspecError(f"{samples_path} is corrupt (not xz-compressed sample lines)") from None
    kept = {s.id: s for s in samples}
    if len(kept) != len(samples) or len(kept) != manifest.get("samples"):
        raise LoopspecError(
            f"{samples_path} holds {len(samples)} samples ({len(kept)} distinct ids), "
            f"its manifest says {manifest.get('samples')}"
        )
    return kept


def pack_kept(data_dir: str | Path, kept_dir: str | Path) -> dict:
    """Write kept_dir from data_dir's samples (and those kept_dir already holds) → its manifest."""
    data_dir, kept_dir = Path(data_dir), Path(kept_dir)
    data_manifest_path = data_dir / "manifest.json"
    if not data_manifest_path.is_file():
        raise LoopspecError(f"no manifest.json in {data_dir} (create it with `loopspec data`)")
    try:
        data_manifest = json.loads(data_manifest_path.read_text())
    except json.JSONDecodeError:  # `loopspec data` rewrites it after every batch
        raise LoopspecError(f"{data_manifest_path} is not JSON (caught mid-write? run again)") from None
    target_hash = data_manifest.get("target_sha256")
    settings = {k: v for k, v in (data_manifest.get("settings") or {}).items() if k != "tap_layer_ids"}
    if "chat_template_sha256" not in settings:
        raise LoopspecError(f"{data_dir} was made by an older `loopspec data` (no chat template hash); regenerate it")
    kept = read_kept(kept_dir, target_hash, settings) if (kept_dir / "manifest.json").is_file() else {}
    for s in read_samples(data_dir):
        if not s.file or not s.line:
            raise LoopspecError(
                f"{data_dir}: sample {s.id} has no prompt file and line (made by an older `loopspec data`)"
            )
        kept.setdefault(s.id, s)  # a sample already kept stays as it was kept
    files = list(dict.fromkeys(s.file for s in kept.values()))
    samples = sorted(kept.values(), key=lambda s: (files.index(s.file), s.line))
    data = lzma.compress(
        "".join(sample_json(s) + "\n" for s in samples).encode("utf-8"), preset=9 | lzma.PRESET_EXTREME
    )
    manifest = {
        "kind": KIND,
        "target": Path(data_manifest.get("target", "")).name,
        "target_sha256": target_hash,
        "settings": settings,
        "samples": len(samples),
        "samples_per_file": dict(Counter(s.file for s in samples)),
        "prompt_tokens": sum(s.prompt_len for s in samples),
        "response_tokens": sum(len(s.tokens) - s.prompt_len for s in samples),
        "finish": dict(Counter(s.finish for s in samples)),
        "samples_sha256": hashlib.sha256(data).hexdigest(),
    }
    kept_dir.mkdir(parents=True, exist_ok=True)
    # samples first, manifest last (each via a rename): an interrupted pack leaves a hash mismatch, not a mix
    for name, content in ((SAMPLES, data), ("manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())):
        tmp = kept_dir / f".{name}.tmp"
        tmp.write_bytes(content)
        os.replace(tmp, kept_dir / name)
    return manifest
