"""What the step-timing scripts share (scripts/step_times.py, cache_copy_ab.py, engine_ab.py, lone_step_ab.py): the
comma-separated grid arguments, the record each JSON starts with (engine, CPU, date), and its writing. Used by
those scripts only: nothing in the package imports this module."""

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
    return {
        "engine": engine_name,
        "cpu": cpu_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "threads": threads,
        "calls": calls,
        **fields,
        "steps": [],
    }


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def alternating_steps(engines: dict, tokens: list[list[int]], lengths: list[int], calls: int) -> tuple[dict, bool]:
    """One verification of `tokens` on each engine in turn, `calls` times, each rolled back to `lengths`
    (calls alternate, so the machine's drifts fall on every engine alike) → ({name: median ms},
    whether every turn's logits were equal across the engines)."""
    import statistics
    import time

    import torch

    times, same = {name: [] for name in engines}, True
    for _ in range(calls):
        logits = []
        for name, engine in engines.items():
            start = time.perf_counter()
            logits.append(engine.verify(tokens, want_taps=False)[0])
            engine.target_rollback(lengths[: len(tokens)])
            times[name].append((time.perf_counter() - start) * 1000)
        same = same and all(torch.equal(logits[0], other) for other in logits[1:])
    return {name: round(statistics.median(t), 2) for name, t in times.items()}, same
