"""One training sample (a prompt and the target's response, as token ids) and its line in a data
directory's samples.jsonl — the format `loopspec data` writes, kept data packs and training reads."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from loopspec.errors import LoopspecError


@dataclass
class Sample:
    id: str
    tokens: list[int]
    prompt_len: int
    finish: str
    file: str = ""  # the prompt file's name
    line: int = 0  # the prompt's 1-based line in that file

    @property
    def loss_mask(self) -> list[bool]:
        """True where the token is part of the response (supervised)."""
        return [i >= self.prompt_len for i in range(len(self.tokens))]


def sample_id(file_name: str, line: int) -> str:
    return f"{file_name}:{line}"


def sample_json(s: Sample) -> str:
    """One line of samples.jsonl (also of a kept samples.jsonl.xz)."""
    return json.dumps(
        {"id": s.id, "file": s.file, "line": s.line, "tokens": s.tokens, "prompt_len": s.prompt_len, "finish": s.finish}
    )


def parse_sample(line: str) -> Sample:
    """Inverse of sample_json; raises ValueError/KeyError/TypeError on a corrupt line."""
    d = json.loads(line)
    s = Sample(d["id"], d["tokens"], d["prompt_len"], d.get("finish", ""), d.get("file", ""), d.get("line", 0))
    if not (
        isinstance(s.tokens, list)
        and all(isinstance(t, int) for t in s.tokens)
        and isinstance(s.prompt_len, int)
        and 0 < s.prompt_len <= len(s.tokens)
    ):
        raise ValueError("bad tokens or prompt_len")
    return s


def safe_name(sample_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", sample_id)


def read_samples(directory: str | Path) -> list[Sample]:
    path = Path(directory) / "samples.jsonl"
    if not path.is_file():
        raise LoopspecError(f"no samples.jsonl in {directory} (create it with `loopspec data`)")
    samples = []
    # a sample is a line with its newline: an unterminated last line is one still being written (or cut
    # by a kill), so a data directory can be read (packed, trained on) while `loopspec data` grows it
    for number, line in enumerate(path.read_text().split("\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            samples.append(parse_sample(line))
        except (ValueError, KeyError, TypeError):
            raise LoopspecError(f"{path}:{number}: corrupt sample line") from None
    return samples
