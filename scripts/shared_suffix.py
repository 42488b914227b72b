"""The suffix library shared across requests (--shared-suffix) against each request's own index alone,
on a set of repeated tasks, in one process on the same prompts.

The set's requests are decoded in order, one at a time, through one Decoder per run (as a server
answers a client that sends them one after another): with the shared library its later requests are
proposed what the earlier ones wrote. For each method (a bench name: suffix, dflash+suffix,
dloop+first3, ...) the run without the library and the run with it alternate, `--repeats` times
each (the order flips every repeat); `ar` decodes the same prompts once first, its tokens the
reference every run must equal (greedy). Reported per run: tokens/s (new tokens over the decoding
wall time, prefill included), tokens per verification over all rounds, τ (committed tokens per
drafting verification), suffix_tokens (committed drafts only the suffix index proposed), and for
each method the ratio of tokens/s with the library to without it (the median over repeats). Run it
with nothing else on the machine for figures that mean anything.

    python scripts/shared_suffix.py [--prompts repeat-edits] [--limit N] [--methods suffix,dflash+suffix]
        [--shared-suffix 16] [--max-new-tokens 128] [--repeats 3] [--backend auto] [--precision auto]
        [--threads T] [--target default] [--drafter default] [--json OUT]
"""

import argparse
import json
import statistics
import time
from datetime import datetime, timezone

from loopspec.runtime.step_costs import cpu_name
from loopspec.prompt_sets import read_prompt_source
from loopspec.runtime.bench.run import cpu_description
from loopspec.runtime.decoder import Decoder, decode_all
from loopspec.runtime.pipeline import load_pipeline
from loopspec.method_names import method_variant
from loopspec.stats import acceptance_length, tokens_per_verification


def decode_in_order(pipe, settings, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The prompts decoded one after another through one Decoder → the run's figures and tokens."""
    decoder = Decoder(pipe.engine, settings)
    rows, seconds = [], 0.0
    for i, ids in enumerate(prompts):
        start = time.perf_counter()
        rows.append(
            decode_all(
                decoder,
                [dict(key=i, prompt_ids=ids, max_new_tokens=max_new_tokens, stop_token_ids=pipe.stop_token_ids)],
            )[i]
        )
        seconds += time.perf_counter() - start
    stats = [r.stats for r in rows]
    new = sum(s.new_tokens for s in stats)
    tau = acceptance_length(stats)
    per_verification = tokens_per_verification(stats)
    return {
        "settings": settings.describe(),
        "new_tokens": new,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(new / seconds, 2),
        "tokens_per_verification": None if per_verification is None else round(per_verification, 3),
        "tau": None if tau is None else round(tau, 3),
        "suffix_tokens": sum(s.suffix_tokens for s in stats),
        "verifications": sum(s.verifications for s in stats),
        "tokens": [r.tokens for r in rows],
    }


def line(name: str, run: dict) -> str:
    tau = "-" if run["tau"] is None else f"{run['tau']:.2f}"
    return (
        f"  {name:28s} {run['tokens_per_s']:8.2f} tok/s  {run['tokens_per_verification'] or 0:5.2f} tok/verif  "
        f"tau {tau:>5s}  suffix_tokens {run['suffix_tokens']:6d}  ({run['new_tokens']} tokens, "
        f"{run['seconds']:.1f} s)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--prompts", default="repeat-edits", help="a built-in set or a prompt file (in its order)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts")
    p.add_argument("--methods", default="suffix,dflash+suffix", help="comma-separated bench names")
    p.add_argument("--shared-suffix", type=int, default=16, help="outputs the shared library keeps")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs of each method with and without the library")
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default")
    p.add_argument("--backend", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.shared_suffix < 1 or args.repeats < 1 or (args.limit is not None and args.limit < 1):
        p.error("--shared-suffix, --repeats and --limit must be >= 1")
    if args.json:
        open(args.json, "a").close()  # an unwritable path fails now, not after the run
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    pipe = load_pipeline(
        args.target,
        args.drafter,
        backend=args.backend,
        precision=args.precision,
        num_threads=args.threads,
        max_context=2048,
    )
    texts = read_prompt_source(args.prompts, args.limit)
    prompts = [pipe.encode(text) for text in texts]
    settings = {}
    for name in methods:
        method, overrides = method_variant(name)
        if method == "suffix":
            overrides = {}
        elif not (overrides.get("suffix") or overrides.get("suffix_first")):
            overrides |= {"suffix": True}  # the library feeds the suffix index: a drafter method needs it on
        settings[name] = {
            on: pipe.settings(method, adaptive=False, **overrides, shared_suffix=args.shared_suffix if on else 0)
            for on in (False, True)
        }
    print(f"{len(prompts)} prompts of {args.prompts}, {pipe.describe_engine()}, {cpu_name()}")
    decode_in_order(pipe, pipe.settings("ar", adaptive=False), prompts[:1], 8)  # warm-up
    ar = decode_in_order(pipe, pipe.settings("ar", adaptive=False), prompts, args.max_new_tokens)
    print(line("ar", ar))
    result = {
        "script": "scripts/shared_suffix.py",
        "cpu": cpu_name(),
        "cpu_features": cpu_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "engine": pipe.describe_engine(),
        "prompts": args.prompts,
        "count": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "shared_suffix": args.shared_suffix,
        "repeats": args.repeats,
        "ar": {k: v for k, v in ar.items() if k != "tokens"},
        "methods": {},
    }
    for name in methods:
        runs = {False: [], True: []}
        for r in range(args.repeats):
            for on in (False, True) if r % 2 == 0 else (True, False):
                run = decode_in_order(pipe, settings[name][on], prompts, args.max_new_tokens)
                run["identical_to_ar"] = run.pop("tokens") == ar["tokens"]
                runs[on].append(run)
                print(line(f"{name} {'shared' if on else 'own index'} #{r + 1}", run))
        ratios = [on["tokens_per_s"] / off["tokens_per_s"] for off, on in zip(runs[False], runs[True])]
        summary = {
            "speed_ratio_shared_over_own": round(statistics.median(ratios), 3),
            "speed_ratios": [round(x, 3) for x in ratios],
            "identical_to_ar": all(run["identical_to_ar"] for rs in runs.values() for run in rs),
            "own_index": runs[False],
            "shared": runs[True],
        }
        result["methods"][name] = summary
        print(
            f"{name}: shared / own index tokens/s {summary['speed_ratio_shared_over_own']:.2f}x (median of "
            f"{args.repeats}), output = ar: {summary['identical_to_ar']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(m["identical_to_ar"] for m in result["methods"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
