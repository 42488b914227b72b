"""What a step costs on the engine in use: the table the verification budget (runtime/budget.py) reads.

A step verifies every live row at once, right-padded to the widest row, so its cost is a function of
the row count and that width; a drafting step also runs the drafter's stage over the rows that draft.
`measure_step_costs` times both on the engine itself (`loopspec costs` stores the result per engine in
loopspec's cache, like `tune`'s setting); `StepCosts.load` reads one back and refuses, in one line naming
the file and the field, a table that cannot be one: missing or unknown fields, a value of the wrong JSON
type (true is no number), ragged or non-positive times, unsorted axes or ones past what an engine holds
(LIMITS), a file too large or nested too deep to be a table (the decoder would recurse), another engine's.
Between measured row counts and widths the cost is interpolated linearly, past the last one extrapolated
from the last two points (a step never costs less than a narrower or smaller one).
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loopspec.errors import LoopspecError

ROWS = (1, 2, 4, 8, 16)
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12)
# What a table may hold. An engine's context holds at most MAX_CONTEXT tokens per row (2^24: beyond any
# target's trained length), and a table is measured inside it: `context` committed tokens and a
# verification of up to widths[-1] more (measure_step_costs keeps context + width < the engine's context).
# A server batches at most MAX_ROWS rows, and `threads` is a CPU's thread count (0: not recorded).
MAX_CONTEXT = 1 << 24
MAX_ROWS = 1 << 16
MAX_THREADS = 1 << 16
MAX_FILE_BYTES = 1 << 20  # a measured table is a few kilobytes
MAX_DEPTH = 8  # a table nests three deep (an object, verify_s, its rows)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one verification of `rows` rows × `widths` tokens (verify_s[i][j]: rows[i], widths[j])
    and of one drafter stage over `rows` drafting rows (draft_s[i], empty: no drafter), at `context`
    committed tokens per row, on the engine named `engine` (backend and precision)."""

    engine: str
    context: int
    rows: tuple[int, ...]
    widths: tuple[int, ...]
    verify_s: tuple[tuple[float, ...], ...]
    draft_s: tuple[float, ...] = ()
    cpu: str = ""
    threads: int = 0

    def __post_init__(self):
        def axis(name, values, most):
            if (
                not isinstance(values, tuple)
                or not values
                or any(not _is_int(v) or not 1 <= v <= most for v in values)
                or list(values) != sorted(set(values))
            ):
                raise LoopspecError(
                    f"step costs: {name} must be increasing integers in [1, {most}], got {_shown(values)}"
                )

        if not isinstance(self.engine, str) or not self.engine:
            raise LoopspecError(f"step costs: engine must be the engine's name (a string), got {_shown(self.engine)}")
        if not _is_int(self.context) or not 1 <= self.context <= MAX_CONTEXT:
            raise LoopspecError(
                f"step costs: context must be an integer in [1, {MAX_CONTEXT}], got {_shown(self.context)}"
            )
        axis("rows", self.rows, MAX_ROWS)
        axis("widths", self.widths, MAX_CONTEXT - self.context)  # measured beside `context` tokens
        if self.widths[0] != 1:
            raise LoopspecError("step costs: widths must start at 1 (the plain step)")
        if (
            not isinstance(self.verify_s, tuple)
            or len(self.verify_s) != len(self.rows)
            or any(not isinstance(r, tuple) or len(r) != len(self.widths) for r in self.verify_s)
        ):
            raise LoopspecError(f"step costs: verify_s must be {len(self.rows)} rows of {len(self.widths)} times")
        if not isinstance(self.draft_s, tuple) or (self.draft_s and len(self.draft_s) != len(self.rows)):
            raise LoopspecError(f"step costs: draft_s must hold {len(self.rows)} times (one per row count) or none")
        for name, times in [("verify_s", t) for t in self.verify_s] + [("draft_s", self.draft_s)]:
            for t in times:
                if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 60:
                    raise LoopspecError(
                        f"step costs: {name}: every time must be a number of seconds in (0, 60), got {_shown(t)}"
                    )
        if not isinstance(self.cpu, str):
            raise LoopspecError(f"step costs: cpu must be the CPU's name (a string), got {_shown(self.cpu)}")
        if not _is_int(self.threads) or not 0 <= self.threads <= MAX_THREADS:
            raise LoopspecError(
                f"step costs: threads must be an integer in [0, {MAX_THREADS}] (0: not recorded), "
                f"got {_shown(self.threads)}"
            )

    def verify(self, rows: int, width: int) -> float:
        """Seconds of one verification of `rows` rows padded to `width` tokens."""
        at_width = [_interpolate(self.widths, r, width) for r in self.verify_s]
        return _interpolate(self.rows, at_width, rows)

    def draft(self, rows: int) -> float:
        """Seconds of one drafter stage over `rows` rows (0 for none)."""
        if rows <= 0:
            return 0.0
        if not self.draft_s:
            raise LoopspecError("step costs: this table has no drafter times; measure it with the drafter loaded")
        return _interpolate(self.rows, self.draft_s, rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def load(cls, path: str | Path, engine: str | None = None) -> "StepCosts":
        """A stored table; `engine` given: refused unless it was measured on that engine."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise LoopspecError(f"step costs {path}: {e.strerror}") from None
        if len(raw) > MAX_FILE_BYTES:
            raise LoopspecError(f"step costs {path}: larger than {MAX_FILE_BYTES} bytes, so not a step-cost table")
        try:
            text = raw.decode("utf-8")
            if _depth(text) > MAX_DEPTH:  # before parsing: the decoder recurses once per level
                raise LoopspecError(f"step costs {path}: JSON nested deeper than {MAX_DEPTH} levels, so not a table")
            data = json.loads(text)
        except ValueError as e:  # (UnicodeDecodeError and JSONDecodeError, a number of too many digits)
            raise LoopspecError(f"step costs {path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise LoopspecError(f"step costs {path}: not a table (a JSON object)")
        missing = [k for k in ("engine", "context", "rows", "widths", "verify_s") if k not in data]
        if missing:
            raise LoopspecError(f"step costs {path}: missing {', '.join(missing)}")
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise LoopspecError(f"step costs {path}: unknown fields {', '.join(sorted(unknown))}")
        try:
            costs = cls(
                **{
                    k: tuple(tuple(r) if isinstance(r, list) else r for r in v) if isinstance(v, list) else v
                    for k, v in data.items()
                }
            )
        except LoopspecError as e:
            raise LoopspecError(f"step costs {path}: {str(e).removeprefix('step costs: ')}") from None
        except TypeError:  # (a field whose value is no list where a list is wanted is refused above)
            raise LoopspecError(f"step costs {path}: verify_s must be a list of lists of seconds") from None
        if engine is not None and costs.engine != engine:
            raise LoopspecError(
                f"step costs {path} were measured on the {costs.engine} engine, not {engine}: "
                "measure this one with `loopspec costs`"
            )
        return costs


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no count


def _shown(value) -> str:
    """A value as the table's JSON writes it, cut short (a refusal stays one readable line)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # (no JSON value; an int of more digits than Python will print)
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _depth(text: str) -> int:
    """How deep `text`'s JSON arrays and objects nest (brackets inside strings not counted)."""
    depth = deepest = 0
    for bracket in re.findall(r"[\[\]{}]", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _interpolate(xs: tuple[int, ...], ys, x: float) -> float:
    """ys at x, piecewise linear through (xs, ys), extended from the end segments (never below half
    the cheapest measured time, however steep the first segment); a single point: proportional to
    x / xs[0] past it, flat before."""
    if len(xs) == 1:
        return ys[0] * max(1.0, x / xs[0])
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, min(ys) * 0.5)


def measure_step_costs(
    engine,
    engine_name: str,
    *,
    rows=ROWS,
    widths=WIDTHS,
    context: int = 256,
    block_size: int = 4,
    repeats: int = 5,
    progress: bool = True,
) -> StepCosts:
    """Time verifications of every (rows, width) and a drafter stage per row count on `engine` (an
    Engine with at least max(rows) rows) at `context` committed tokens per row; medians of `repeats`,
    widths interleaved within each repeat so a transient slowdown spreads over all of them."""
    from tqdm import tqdm

    rows = tuple(r for r in rows if r <= engine.max_rows)
    widths = tuple(w for w in widths if context + w < engine.max_context)
    if not rows or context + 1 >= engine.max_context:
        raise LoopspecError(
            f"step costs: the engine holds {engine.max_rows} rows of {engine.max_context} tokens; "
            f"cannot measure at a context of {context}"
        )
    vocab = engine.target_cfg.vocab_size
    prompt = [(10 + i * 7) % vocab for i in range(context)]
    for b in range(max(rows)):
        engine.prefill(b, prompt, want_taps=engine.has_drafter)
    verify_s, draft_s = [], []
    bar = tqdm(total=len(rows) * (repeats + 1), desc="step costs", disable=not progress, file=sys.stderr)
    for n in rows:
        times: dict[int, list[float]] = {w: [] for w in widths}
        stage: list[float] = []
        for repeat in range(repeats + 1):  # the first repeat warms up
            for w in widths:
                t0 = time.perf_counter()
                engine.verify([[(20 + i) % vocab for i in range(w)]] * n, want_taps=engine.has_drafter)
                engine.target_rollback([context] * n)
                if repeat:
                    times[w].append(time.perf_counter() - t0)
            if engine.has_drafter:
                lengths = engine.context_lengths(list(range(n)))
                t0 = time.perf_counter()
                engine.draft(list(range(n)), [5] * n, [context] * n, block_size)
                if repeat:
                    stage.append(time.perf_counter() - t0)
                engine.context_rollback(list(range(n)), lengths)
            bar.update()
        verify_s.append(tuple(statistics.median(times[w]) for w in widths))
        if stage:
            draft_s.append(statistics.median(stage))
    bar.close()
    return StepCosts(
        engine=engine_name,
        context=context,
        rows=rows,
        widths=widths,
        verify_s=tuple(verify_s),
        draft_s=tuple(draft_s),
        cpu=cpu_name(),
        threads=_threads(),
    )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def stored_costs_path(engine_name: str, store: Path | None = None) -> Path:
    """Where `loopspec costs` keeps the table of an engine (backend and precision):
    `<cache>/step-costs/<engine>.json` (loopspec.weights.cache_root)."""
    if store is None:
        from loopspec.weights import cache_root

        store = cache_root() / "step-costs"
    return Path(store) / f"{engine_name.replace(' ', '-')}.json"


def stored_step_costs(engine_name: str, store: Path | None = None) -> StepCosts | None:
    """The table `loopspec costs` stored for `engine_name`, if one was measured on this CPU (a table
    from another CPU, or one that no longer reads, is left out with a note on stderr)."""
    path = stored_costs_path(engine_name, store)
    if not path.is_file():
        return None
    try:
        costs = StepCosts.load(path, engine=engine_name)
    except LoopspecError as e:
        print(f"loopspec: note: {e}; the timing fallback decides instead", file=sys.stderr)
        return None
    if costs.cpu != cpu_name():
        print(
            f"loopspec: note: the step costs in {path} were measured on {costs.cpu or 'another CPU'}, not this "
            f"{cpu_name()}: the timing fallback decides instead (run `loopspec costs` again)",
            file=sys.stderr,
        )
        return None
    return costs
