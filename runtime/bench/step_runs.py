"""What the step-timing scripts share (scripts/step_times.py, cache_copy_ab.py, lone_step_ab.py): the
comma-separated grid arguments, the record each JSON starts with (engine, CPU, date), and its writing."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from loopspec.runtime.bench.run import cpu_description


def integers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def reserve_json(path: str | None) -> None:
    if path:
        open(path, "a").close()  # an unwritable path fails now, not after the run


def run_record(engine_name: str, threads: int, calls: int, **fields) -> dict:
    """The JSON's head: what ran, where and when; its points go in "steps"."""
    return {"engine": engine_name, "cpu": cpu_description(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "threads": threads, "calls": calls,
            **fields, "steps": []}


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
