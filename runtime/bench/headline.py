"""The headline table of a bench.json: one line per engine and method, each figure a range over the
run's datasets (what the README quotes, regenerated from the committed report by
`scripts/headline_table.py`, so every number in it can be traced to that file). Used by scripts/headline_table.py
and scripts/step_table.py only (tests/test_figures.py checks them): nothing in the package imports this module.

Speed is against the same engine's `ar` (the first engine's `ar` against the other engine's), and
for llama.cpp's rows against its plain decoding; τ counts the verifications that checked drafts,
tokens per verification every round (the adaptive fallback's plain rounds included)."""

from __future__ import annotations

from loopspec.errors import LoopspecError
from loopspec.settings import DecodingSettings

PLAIN_PEER, DRAFTING_PEER = "llamacpp", "llamacpp-dflash"


def _span(values: list[float], fmt: str, suffix: str = "") -> str:
    low, high = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return f"{low}{suffix}" if low == high else f"{low}–{high}{suffix}"


def _by_dataset(results: list[dict], method: str, backend: str) -> dict[str, dict]:
    return {r["dataset"]: r for r in results if r["method"] == method and r["backend"] == backend}


def _identical(rows: dict[str, dict]) -> str:
    same = sum(1 for r in rows.values() if r["identical_to_ar"])
    return f"{same} of {len(rows)} sets"


def headline_table(report: dict) -> str:
    """Markdown table of `report` (a bench.json): engines in the order they ran, `ar` first. Used by
    scripts/headline_table.py."""
    results, settings = report["results"], report.get("settings", {})
    engines = list(settings.get("engines", {}))
    if not engines:
        raise LoopspecError("bench.json names no engine (settings.engines): not a loopspec bench report")
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    reference = _by_dataset(results, "ar", engines[0])
    lines = [
        f"| what decodes ({len(datasets)} sets: {', '.join(datasets)}) | tok/s | speed | τ, drafting rounds "
        "| tokens / verification, all rounds | output = its `ar` |",
        "|---|---|---|---|---|---|",
    ]
    best = {d: 0.0 for d in datasets}  # the first engine's fastest method per set, against llama.cpp
    for engine in engines:
        engine_ar = _by_dataset(results, "ar", engine)
        for method, decoding in settings["engines"][engine]["decoding"].items():
            rows = _by_dataset(results, method, engine)
            if not rows:
                continue
            speeds = [rows[d]["tokens_per_s"] for d in rows]
            if engine == engines[0]:
                for d in rows:
                    best[d] = max(best[d], rows[d]["tokens_per_s"])
            setting = DecodingSettings(**decoding).describe().split(", ", 1)  # "dloop, k=4, ..." → the rest
            label = f"`{engine}`, `{method}`" + (f": {setting[1]}" if method != "ar" and len(setting) > 1 else "")
            if method == "ar":
                speed = (
                    "1×"
                    if engine == engines[0]
                    else _span(
                        [rows[d]["tokens_per_s"] / reference[d]["tokens_per_s"] for d in rows],
                        ".2f",
                        f"× `{engines[0]}`'s `ar`",
                    )
                )
                lines.append(f"| {label} | {_span(speeds, '.1f')} | {speed} | 1 | 1 | – |")
                continue
            ratio = _span([rows[d]["tokens_per_s"] / engine_ar[d]["tokens_per_s"] for d in rows], ".2f", "× its `ar`")
            taus = [rows[d]["tau"] for d in rows if rows[d]["tau"] is not None]
            per_verification = [
                rows[d]["tokens_per_verification"]
                if rows[d].get("tokens_per_verification") is not None
                else _tokens_per_verification(rows[d])
                for d in rows
            ]
            lines.append(
                f"| {label} | {_span(speeds, '.1f')} | {ratio} | {_span(taus, '.2f')} "
                f"| {_span(per_verification, '.2f')} | {_identical(rows)} |"
            )
    plain = _by_dataset(results, PLAIN_PEER, "llama.cpp")
    if plain:
        reach = _span([best[d] / plain[d]["tokens_per_s"] for d in plain], ".2f", "×")
        # a server that had to run without its weight repacking (it crashed with it) is not its normal speed
        commands = settings.get("llamacpp", {}).values()
        no_repack = ", `--no-repack`" if any("--no-repack" in command for command in commands) else ""
        lines.append(
            f"| llama.cpp `llama-server`, same GGUF, plain{no_repack} "
            f"| {_span([r['tokens_per_s'] for r in plain.values()], '.1f')} "
            f"| `{engines[0]}`'s fastest method per set reaches {reach} of it | 1 | 1 | – |"
        )
        drafting = _by_dataset(results, DRAFTING_PEER, "llama.cpp")
        if drafting:
            ratios = [drafting[d]["tokens_per_s"] / plain[d]["tokens_per_s"] for d in drafting]
            lines.append(
                f"| llama.cpp's own DFlash, same drafter "
                f"| {_span([r['tokens_per_s'] for r in drafting.values()], '.1f')} "
                f"| {_span(ratios, '.2f', '× its plain')} "
                f"| {_span([r['tau'] for r in drafting.values()], '.2f')} "
                f"| {_span([r['tau'] for r in drafting.values()], '.2f')} "
                f"| {_identical(drafting)} (its plain output) |"
            )
    return "\n".join(lines)


def _tokens_per_verification(row: dict) -> float:
    """For reports written before the field existed: every token but each request's first (sampled at
    prefill) came from a verification."""
    return (row["new_tokens"] - row["prompts"]) / row["verifications"]


def per_set_table(report: dict) -> str:
    """Markdown table of `report`: one line per engine and method, one column per dataset; a cell is
    tok/s (τ / tokens per verification, speed against the same engine's `ar`, or llama.cpp's plain).
    Used by scripts/headline_table.py --per-set."""
    results, engines = report["results"], list(report.get("settings", {}).get("engines", {}))
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    lines = ["| method, engine | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
    order = list(dict.fromkeys((r["method"], r["backend"]) for r in results))
    order.sort(key=lambda mb: (mb[1] not in engines, engines.index(mb[1]) if mb[1] in engines else 0))
    for method, backend in order:
        rows = _by_dataset(results, method, backend)
        reference = _by_dataset(results, "ar" if backend in engines else PLAIN_PEER, backend)
        cells = []
        for d in datasets:
            r = rows.get(d)
            if r is None:
                cells.append("–")
            elif r["tau"] in (None, 1.0) and method in ("ar", PLAIN_PEER):
                cells.append(f"{r['tokens_per_s']:.1f}")
            else:
                per_verification = (
                    r["tokens_per_verification"]
                    if r.get("tokens_per_verification") is not None
                    else _tokens_per_verification(r)
                )
                cells.append(
                    f"{r['tokens_per_s']:.1f} ({r['tau']:.2f} / {per_verification:.2f}, "
                    f"{r['tokens_per_s'] / reference[d]['tokens_per_s']:.2f}×)"
                )
        lines.append(f"| `{method}`, {backend} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PEER_LABELS = {"onnxruntime-genai": "GenAI int4", "llama.cpp": "llama.cpp"}


def step_table(ours: dict, genai_runs: list[dict]) -> str:
    """Markdown table of a step grid (`scripts/step_times.py --json`) beside its peers: those the same
    run timed (its "peers": llama.cpp's llama-bench, ONNX Runtime GenAI) and ONNX Runtime GenAI's
    curves from separate runs (`scripts/genai_step.py --curve --json`, one or more, shown as `a / b`):
    one line per k new tokens on one row, one column per engine and context (and our step graph's
    session alone where the run timed it: "bare_ms"); then one line per rows of one token (ours
    only). Used by scripts/step_table.py."""

    def at(records: list[dict], k: int, rows: int, context: int, field: str = "ms") -> float | None:
        # a multi-row point sits at contexts spread below the nominal one: the nearest nominal context
        hits = [
            r[field]
            for r in records
            if r["k"] == k
            and r["rows"] == rows
            and field in r
            and min(contexts, key=lambda c: abs(c - r["context"])) == context
        ]
        return hits[0] if hits else None

    steps = ours["steps"]
    contexts = sorted({r["context"] for r in steps if r["rows"] == 1})  # the nominal contexts
    chains = sorted({r["k"] for r in steps if r["rows"] == 1})
    rows = sorted({r["rows"] for r in steps if r["k"] == 1})
    peers = [(PEER_LABELS.get(name, name), [peer["steps"]]) for name, peer in ours.get("peers", {}).items()]
    if genai_runs:
        peers.append(("GenAI int4", [run["steps"] for run in genai_runs]))
    columns = [
        (label, runs, c) for label, runs in peers for c in contexts if any(at(run, 1, 1, c) is not None for run in runs)
    ]
    bare = [c for c in contexts if at(steps, 1, 1, c, "bare_ms") is not None]  # its session alone, where timed
    header = [f"ours, {c}" for c in contexts] + [f"ours' session alone, {c}" for c in bare]
    header += [f"{label}, {c}" for label, _, c in columns]
    lines = ["| k new tokens, one row (ms) | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for k in chains:
        cells = [_ms(at(steps, k, 1, c)) for c in contexts] + [_ms(at(steps, k, 1, c, "bare_ms")) for c in bare]
        cells += [" / ".join(_ms(at(run, k, 1, c)) for run in runs) for _, runs, c in columns]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| rows of one token (ms) | " + " | ".join(f"ours, {c}" for c in contexts) + " |",
        "|---" * (len(contexts) + 1) + "|",
    ]
    lines += [f"| {n} | " + " | ".join(_ms(at(steps, 1, n, c)) for c in contexts) + " |" for n in rows]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"
