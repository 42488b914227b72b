"""The `loopspec bench` report, from bench.json: the table it prints, and with `--out DIR` bench.md
(tables per dataset) and PNG plots.

Everything here reads the JSON report only, so a saved bench.json can be rendered again. matplotlib
is imported lazily and draws with its Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

from pathlib import Path

from loopspec.errors import LoopspecError

DRAFTING = ("dflash", "dloop", "suffix")  # methods whose rows carry acceptance data (and their +variants)
SPLIT = (("prefill_s", "prefill"), ("draft_s", "draft"), ("verify_s", "verify"), ("other_s", "other"))
CURVE_COLUMNS = 10  # per-position acceptance table: first positions only (the JSON has all of them)
MAX_TICKS = 16


def write_report(report: dict, out_dir: Path) -> list[Path]:
    """Write the plots and bench.md into out_dir; returns the paths written."""
    out_dir = Path(out_dir)
    plots = write_plots(report, out_dir)
    md = out_dir / "bench.md"
    md.write_text(markdown(report, [p.name for p in plots]))
    return [md] + plots


def _base(method: str) -> str:
    """'dloop+tree16+suffix' → 'dloop'."""
    return method.split("+")[0]


def _drafts(r: dict) -> bool:
    return _base(r["method"]) in DRAFTING


def _tree_point(method: str) -> tuple[str, int, bool] | None:
    """'dflash+tree16+suffix' → ('dflash', 16, True); the chain is budget 0; None for other methods."""
    base, *parts = method.split("+")
    if (
        base not in ("dflash", "dloop")
        or not parts
        or any(p not in ("chain", "suffix") and not (p.startswith("tree") and p[4:].isdigit()) for p in parts)
    ):
        return None  # a bare name (the tuned setting) or an unknown label: no budget to place it at
    budget = next((int(p[4:]) for p in parts if p.startswith("tree")), 0)
    return base, budget, "suffix" in parts


# ---------------------------------------------------------------- markdown

PEER_LIBRARIES = ("transformers", "llama.cpp")  # a peer row's `backend`: it reports no time split


def _is_peer(r: dict) -> bool:
    return r["backend"] in PEER_LIBRARIES


def _label(r: dict) -> str:
    return f"{r['method']} ({r['backend']})"


def _num(value, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _same(value) -> str:
    return "–" if value is None else ("yes" if value else "**no**")


def _datasets(results: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["dataset"] for r in results))


def _bound(r: dict) -> str:
    if r.get("speedup_bound") is None:
        return "–"
    return f"{r['speedup_bound']:.2f}× / {_num(r.get('speedup_bound_as_run'), '.2f', '×')}"


def _split_ms_per_token(r: dict) -> str:
    tokens = max(r["new_tokens"], 1)
    if _is_peer(r):
        return f"– / – / – / {r['other_s'] * 1e3 / tokens:.1f} (not split)"
    return " / ".join(f"{r[key] * 1e3 / tokens:.1f}" for key, _ in SPLIT)


def results_table(results: list[dict]) -> str:
    """The table `loopspec bench` prints: one line per (dataset, method, engine) row of bench.json."""
    width = max([11] + [len(r["method"]) + 2 for r in results])  # variants (dloop+tree16+suffix) are long
    engine = max([9] + [len(r["backend"]) + 2 for r in results])  # "onnxruntime gguf-int8act"
    head = (
        f"{'dataset':<14}{'method':<{width}}{'engine':<{engine}}{'prompts':>8}{'tokens':>8}{'tau':>7}{'tok/ver':>8}{'tok/s':>8}"
        f"{'speedup':>9}{'bound':>8}{'same as ar':>12}{'= fp32':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        speed = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x"
        bound = "-" if r["speedup_bound"] is None else f"{r['speedup_bound']:.2f}x"
        same = "-" if r["identical_to_ar"] is None else ("yes" if r["identical_to_ar"] else "NO")
        agree = "-" if r["agreement_with_fp32"] is None else f"{r['agreement_with_fp32']:.0%}"
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        per_verification = _num(r.get("tokens_per_verification"), ".2f").replace("–", "-")
        lines.append(
            f"{r['dataset']:<14}{r['method']:<{width}}{r['backend']:<{engine}}{r['prompts']:>8}"
            f"{r['new_tokens']:>8}{tau:>7}{per_verification:>8}{r['tokens_per_s']:>8.1f}{speed:>9}{bound:>8}{same:>12}{agree:>8}"
        )
    return "\n".join(lines)


def markdown(report: dict, plot_files: list[str] = ()) -> str:
    results, settings, cm = report["results"], report.get("settings", {}), report.get("cost_model")
    datasets = _datasets(results)
    repeats = settings.get("repeats", 1)
    lines = ["# loopspec bench", ""]
    if settings.get("command"):
        lines += ["```sh", settings["command"], "```", ""]
    if settings:
        machine = settings.get("machine", {})
        sampling = settings.get("sampling", {})
        loop = settings.get("dloop")
        lines += [
            f"- target `{settings.get('target')}`, drafter: {settings.get('drafter')}, "
            f"backend `{settings.get('backend')}` on `{settings.get('device', 'cpu')}`",
            f"- {settings.get('max_new_tokens')} new tokens, temperature {sampling.get('temperature')}, "
            f"{repeats} repeat(s) (each prompt's median wall time), adaptive fallback "
            f"{'on' if settings.get('adaptive') else 'off'}, block size "
            + ", ".join(f"{m} {k}" for m, k in (settings.get("block_size") or {}).items())
            + (f", DLoop gate {loop['gate_threshold']}, max stages {loop['max_stages']}" if loop else ""),
            f"- {machine.get('cpu') or machine.get('processor')}, {machine.get('platform')}"
            f"{', ' + settings['date'] if settings.get('date') else ''}, torch {machine.get('torch')} "
            f"({machine.get('torch_threads')} threads), transformers {machine.get('transformers')}",
            "",
        ]

    lines += ["## Speedup over `ar`", "", "| method | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
    for label in dict.fromkeys(_label(r) for r in results):
        cells = []
        for d in datasets:
            row = next((r for r in results if r["dataset"] == d and _label(r) == label), None)
            cells.append("–" if row is None else _num(row["speedup_vs_ar"], ".2f", "×"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")

    if cm is not None:
        verify = ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in cm["verify_s"].items())
        lines += [
            "## Cost model of this machine",
            "",
            "| quantity | value |",
            "|---|---|",
            f"| memory read bandwidth | {cm['bandwidth_gbs']:.1f} GB/s |",
            f"| target weights | {cm['target_weight_mb']:.0f} MB |",
            f"| plain-decoding bound (bandwidth ÷ weight bytes) | {cm['ar_bound_tokens_per_s']:.1f} tokens/s |",
            f"| t_verify(n) after 128 tokens of context, n: ms | {verify} |",
            f"| drafter stage | {_num(cm.get('draft_stage_s') and cm['draft_stage_s'] * 1e3, '.1f', ' ms')} |",
            "",
            "Bounds of a drafting method: *drafting* = τ · t_verify(1) / (stages · t_draft + t_verify(drafts + 1)), "
            "the speedup if every round drafted at this τ; *as run* = the same over the rounds it ran, where "
            "the plain rounds (adaptive fallback, the last token of a request) commit 1 token in t_verify(1). "
            "Prefill is outside both.",
            "",
        ]

    for d in datasets:
        rows = [r for r in results if r["dataset"] == d]
        count = rows[0]["prompts"]
        lines += [
            f"## {d} ({count} prompt{'' if count == 1 else 's'})",
            "",
            "| method | engine | τ | tokens / verification, all rounds | tok/s | speedup vs `ar` "
            "| bound: drafting / as run | identical to `ar` "
            "| greedy output = fp32 `ar` | nodes / verification | tokens only the suffix proposed "
            "| stages / verification | tokens from stages > 1 | verifications saved "
            "| prefill / draft / verify / other, ms per token |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['method']} | {r['backend']} | {_num(r['tau'], '.2f')} "
                f"| {_num(r.get('tokens_per_verification'), '.2f')} "
                f"| {r['tokens_per_s']:.1f} "
                f"| {_num(r['speedup_vs_ar'], '.2f', '×')} | {_bound(r)} "
                f"| {_same(r['identical_to_ar'])}{'' if r.get('same_across_repeats', True) else ' (repeats differ!)'} "
                f"| {_num(r.get('agreement_with_fp32') and 100 * r['agreement_with_fp32'], '.0f', ' %')} "
                f"| {_num(r.get('nodes_per_verification'), '.1f')} "
                f"| {_num(r.get('suffix_share') and 100 * r['suffix_share'], '.1f', ' %')} "
                f"| {_num(r['stages_per_verification'], '.2f')} "
                f"| {_num(r['later_stage_share'] and 100 * r['later_stage_share'], '.1f', ' %')} "
                f"| {_num(r['verifications_saved'], 'd')} | {_split_ms_per_token(r)} |"
            )
        curves = [r for r in rows if _drafts(r) and r.get("acceptance_curve")]
        if curves:
            width = min(CURVE_COLUMNS, max(len(r["acceptance_curve"]) for r in curves))
            lines += [
                "",
                "P(the draft at position i is accepted), over the verifications that checked drafts:",
                "",
                "| method | verifications | " + " | ".join(str(i) for i in range(1, width + 1)) + " |",
                "|---|---|" + "---|" * width,
            ]
            for r in curves:
                cells = [f"{p:.2f}" for p in r["acceptance_curve"][:width]] + ["–"] * (
                    width - len(r["acceptance_curve"])
                )
                lines.append(f"| {r['method']} | {r['drafting_verifications']} | " + " | ".join(cells) + " |")
        lines.append("")

    lines += [
        "Speed is generated tokens per wall-clock second, prefill included. τ counts the tokens committed per "
        "verification that checked drafts; tokens per verification counts every round, the plain ones (adaptive "
        "fallback, a request's last tokens) included, and is what the speed sees. Verifications saved (DLoop) = "
        "Σ over its verifications of ceil(committed / k) − 1: how many more verifications a one-stage DFlash "
        "round of block k would have needed for the same committed tokens.",
        "",
    ]
    if plot_files:
        lines += ["## Plots", ""] + [f"![{Path(f).stem.replace('_', ' ')}]({f})" for f in plot_files] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots


def _figure(columns: int = 1, width: float = 7.5, height: float = 4.0, sharey: bool = True, column_width: float = 4.2):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise LoopspecError("the bench plots need matplotlib: pip install 'loopspec[bench]'") from None
    fig = Figure(figsize=(max(width, column_width * columns), height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, columns, sharey=sharey, squeeze=False)[0]
    return fig, list(axes)


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    """One group of bars per x label, one bar per series."""
    width = 0.8 / max(len(series), 1)
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    step = -(-len(groups) // MAX_TICKS)  # label every step-th group when there are many
    ax.set_xticks(range(0, len(groups), step), groups[::step])


def _fractions(counts: list[int], size: int) -> list[float]:
    """Counts as shares of their total, cut or zero-padded to `size` bins."""
    total = max(sum(counts), 1)
    return [c / total for c in counts[:size]] + [0.0] * (size - len(counts))


def _integer_ticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_speedup(results: list[dict], path: Path) -> Path:
    datasets = _datasets(results)
    reference = _label(results[0]) if results and results[0]["method"] == "ar" else None  # 1.0 by definition
    labels = [l for l in dict.fromkeys(_label(r) for r in results) if l != reference]
    fig, (ax,) = _figure(width=max(7.5, 1.6 * len(datasets) + 3))
    width = 0.8 / max(len(labels), 1)
    legend_done = set()
    for j, label in enumerate(labels):
        rows = [next((r for r in results if r["dataset"] == d and _label(r) == label), None) for d in datasets]
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(datasets))]
        ax.bar(xs, [r["speedup_vs_ar"] if r else 0 for r in rows], width, label=label)
        for key, marker, name in (
            ("speedup_bound", "_", "bound: drafting"),
            ("speedup_bound_as_run", "x", "bound: as run"),
        ):
            bounds = [(x, r[key]) for x, r in zip(xs, rows) if r and r.get(key)]
            if bounds:
                ax.scatter(
                    *zip(*bounds),
                    marker=marker,
                    s=120 if marker == "x" else 300,
                    color="black",
                    zorder=3,
                    label=None if key in legend_done else name,
                )
                legend_done.add(key)
    ax.axhline(1.0, color="gray", linewidth=1, linestyle="--", label="ar")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("speedup over ar (tokens/s)")
    ax.set_title("Speedup per dataset")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path)
    return path


def _series_name(r: dict, results: list[dict]) -> str:
    """The dataset, and the backend when several ran (their rows would share a name otherwise)."""
    several = len({x["backend"] for x in results if not _is_peer(x)}) > 1
    return f"{r['dataset']} ({r['backend']})" if several else r["dataset"]


def plot_acceptance(results: list[dict], block_sizes: dict, path: Path) -> Path | None:
    methods = list(dict.fromkeys(r["method"] for r in results if _drafts(r) and r.get("acceptance_curve")))
    if not methods:
        return None
    fig, axes = _figure(len(methods))
    for ax, method in zip(axes, methods):
        rows = [r for r in results if r["method"] == method and r.get("acceptance_curve")]
        for r in rows:
            curve = r["acceptance_curve"]
            ax.plot(range(1, len(curve) + 1), curve, marker="o", markersize=3, label=_series_name(r, results))
        drafts_per_stage = block_sizes.get(method, 0) - 1
        positions = max(len(r["acceptance_curve"]) for r in rows)
        for boundary in range(drafts_per_stage, positions, drafts_per_stage) if drafts_per_stage > 0 else ():
            ax.axvline(boundary + 0.5, color="gray", linewidth=0.8, linestyle=":")  # the next stage's drafts
        _integer_ticks(ax)
        ax.set_title(f"{method}: per-position acceptance")
        ax.set_xlabel("draft position i in the verification")
        ax.set_ylim(0, 1)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("P(draft i accepted)")
    fig.savefig(path)
    return path


def plot_tau_histogram(results: list[dict], path: Path) -> Path | None:
    methods = list(dict.fromkeys(r["method"] for r in results if _drafts(r) and r.get("drafting_verifications")))
    if not methods:
        return None
    fig, axes = _figure(len(methods))
    for ax, method in zip(axes, methods):
        rows = [r for r in results if r["method"] == method and r.get("drafting_verifications")]
        # up to the longest accepted run seen (the JSON keeps every bin up to the maximum possible)
        size = max(2, max(max((i for i, c in enumerate(r["accepted_histogram"]) if c), default=0) + 2 for r in rows))
        series = {_series_name(r, results): _fractions(r["accepted_histogram"], size) for r in rows}
        _grouped_bars(ax, [str(n + 1) for n in range(size)], series)
        ax.set_title(f"{method}: tokens committed per verification")
        ax.set_xlabel("τ of one verification (accepted drafts + 1)")
        ax.legend(fontsize="small")
    axes[0].set_ylabel("share of verifications")
    fig.savefig(path)
    return path


def plot_time_split(results: list[dict], path: Path) -> Path:
    datasets = _datasets(results)
    fig, axes = _figure(len(datasets), height=4.5, column_width=3.2)
    for ax, d in zip(axes, datasets):
        rows = [r for r in results if r["dataset"] == d]
        bottom = [0.0] * len(rows)
        for key, name in SPLIT:
            values = [
                0.0 if (_is_peer(r) and key != "other_s") else r[key] * 1e3 / max(r["new_tokens"], 1) for r in rows
            ]
            ax.bar(
                range(len(rows)), values, 0.7, bottom=bottom, label=name if key != "other_s" else "other (peers: all)"
            )
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(rows)), [r["method"] for r in rows], rotation=45)
        ax.set_title(d)
    axes[0].set_ylabel("ms per generated token")
    axes[-1].legend(fontsize="small")
    fig.suptitle("Where the time goes")
    fig.savefig(path)
    return path


def plot_dloop_stages(results: list[dict], path: Path) -> Path | None:
    rows = [r for r in results if _base(r["method"]) == "dloop" and r.get("stages_histogram")]
    if not rows:
        return None
    size = max(len(r["stages_histogram"]) for r in rows)
    fig, (ax,) = _figure()
    series = {_series_name(r, results): _fractions(r["stages_histogram"], size) for r in rows}
    _grouped_bars(ax, [str(s) if s else "0 (plain)" for s in range(size)], series)
    ax.set_xlabel("draft stages before the verification")
    ax.set_ylabel("share of verifications")
    ax.set_title("DLoop: stages per verification")
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def plot_tree_budget(results: list[dict], path: Path) -> Path | None:
    """τ and speedup against the draft-tree budget (0 = the chain), one line per dataset, method and
    suffix choice — drawn when some method ran at two budgets or more."""
    lines: dict[tuple, list[tuple[int, float, float]]] = {}
    for r in results:
        point = _tree_point(r["method"])
        if point is None or r.get("tau") is None or r.get("speedup_vs_ar") is None:
            continue
        base, budget, suffix = point
        key = (_series_name(r, results), base, suffix)
        lines.setdefault(key, []).append((budget, r["tau"], r["speedup_vs_ar"]))
    lines = {k: sorted(v) for k, v in lines.items() if len({b for b, _, _ in v}) > 1}
    if not lines:
        return None
    fig, (ax_tau, ax_speed) = _figure(2, sharey=False)
    for (series, base, suffix), points in lines.items():
        label = f"{series}: {base}{' + suffix' if suffix else ''}"
        style = "--" if suffix else "-"
        budgets = [b for b, _, _ in points]
        ax_tau.plot(budgets, [t for _, t, _ in points], style, marker="o", markersize=3, label=label)
        ax_speed.plot(budgets, [s for _, _, s in points], style, marker="o", markersize=3, label=label)
    ax_speed.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")
    for ax, name in ((ax_tau, "τ (tokens per verification)"), (ax_speed, "speedup over ar")):
        ax.set_xlabel("draft-tree nodes per verification (0 = chain)")
        ax.set_ylabel(name)
    ax_tau.set_title("τ against the tree budget")
    ax_speed.set_title("speed against the tree budget")
    ax_speed.legend(fontsize="x-small")
    fig.savefig(path)
    return path


def plot_cost_model(cm: dict, path: Path) -> Path:
    lengths = [int(n) for n in cm["verify_s"]]
    times = [t * 1e3 for t in cm["verify_s"].values()]
    fig, (ax,) = _figure()
    ax.plot(lengths, times, marker="o", label="t_verify(n)")
    ax.plot(lengths, [times[0] * n for n in lengths], linestyle=":", color="gray", label="n × t_verify(1)")
    if cm.get("draft_stage_s"):
        ax.axhline(cm["draft_stage_s"] * 1e3, color="tab:green", linestyle="--", label="one drafter stage")
    ax.set_ylim(0, max(times) * 1.3)
    ax.set_xlabel("tokens verified in one target forward (n)")
    ax.set_ylabel("ms")
    ax.set_title("Cost model: verification time vs tokens")
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    results = report["results"]
    written = [
        plot_speedup(results, out_dir / "speedup.png"),
        plot_acceptance(results, report.get("settings", {}).get("block_size", {}), out_dir / "acceptance.png"),
        plot_tau_histogram(results, out_dir / "tau_histogram.png"),
        plot_time_split(results, out_dir / "time_split.png"),
        plot_dloop_stages(results, out_dir / "dloop_stages.png"),
        plot_tree_budget(results, out_dir / "tree_budget.png"),
    ]
    if report.get("cost_model"):
        written.append(plot_cost_model(report["cost_model"], out_dir / "cost_model.png"))
    return [p for p in written if p is not None]
