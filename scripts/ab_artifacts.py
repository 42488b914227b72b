"""Two exported artifact directories (`loopspec convert onnx --out DIR`) side by side in one process:
the same prompts, each method run on A and on B in turn (the order alternating per prompt), after one
uncounted warm-up prompt; tokens/s, τ and draft ms per token of each, and B's speed over A's. For a
change to the engines (an export of the code before against one of the code after, same pair and
precision), where `loopspec bench` compares methods on one engine.

    python scripts/ab_artifacts.py BEFORE/ AFTER/ --prompts humaneval math500 --limit 8 \
        --methods ar dflash+chain dloop [--block-size 8 --no-adaptive]

Methods are named as `loopspec bench` names them; --block-size and --no-adaptive apply to the drafter
methods of both.
"""

import argparse
import sys
import time
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.runtime.bench import load_prompt_sets
from loopspec.engines.backends import artifact_engine
from loopspec.runtime.pipeline import artifact_pipeline
from loopspec.method_names import method_variant
from loopspec.settings import DRAFTER_METHODS
from loopspec.stats import acceptance_length


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="artifact directory A (before)")
    p.add_argument("b", type=Path, help="artifact directory B (after)")
    p.add_argument("--prompts", nargs="+", default=["humaneval"])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", nargs="+", default=["ar", "dloop"])
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--no-adaptive", action="store_true", help="drafter methods without the adaptive fallback")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:
        pipes = {
            name: artifact_pipeline(artifact_engine("onnxruntime", d, None, args.threads), d)
            for name, d in (("A", args.a), ("B", args.b))
        }
        settings = {}
        for name in args.methods:
            method, overrides = method_variant(name)
            if method in DRAFTER_METHODS:
                overrides |= ({"block_size": args.block_size} if args.block_size else {}) | (
                    {"adaptive": False} if args.no_adaptive else {}
                )
            settings[name] = {k: pipe.settings(method, **overrides) for k, pipe in pipes.items()}
        prompts = [pipes["A"].encode(t) for ps in load_prompt_sets(args.prompts, args.limit).values() for t in ps]
    except LoopspecError as e:
        p.error(str(e))
    totals = {(k, m): {"tokens": 0, "seconds": 0.0, "draft_s": 0.0, "stats": []} for k in pipes for m in settings}
    for i, ids in enumerate([prompts[0]] + prompts):  # the first prompt once more, uncounted: warm-up
        for m in settings:
            for k in "AB" if i % 2 else "BA":
                t0 = time.perf_counter()
                result = pipes[k].run(ids, settings[m][k], max_new_tokens=args.max_new_tokens)
                seconds = time.perf_counter() - t0
                if i:
                    total = totals[k, m]
                    total["tokens"] += len(result.tokens)
                    total["seconds"] += seconds
                    total["draft_s"] += result.stats.draft_s
                    total["stats"].append(result.stats)
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens; A {args.a}, B {args.b}")
    for m in settings:
        row = []
        for k in pipes:
            t = totals[k, m]
            tau = acceptance_length(t["stats"])
            row.append(
                f"{k} {t['tokens'] / t['seconds']:6.1f} tok/s, tau {tau if tau else 1.0:.2f}, "
                f"draft {t['draft_s'] / t['tokens'] * 1e3:.2f} ms/token"
            )
        a, b = (totals[k, m]["tokens"] / totals[k, m]["seconds"] for k in pipes)
        print(f"{m:<20} " + " | ".join(row) + f" | B/A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
