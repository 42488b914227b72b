"""τ of the FP8 drafter against the fp32 drafter on the default pair, both through ONNX Runtime.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/fp8_drop.py [--eval-dir DIR] [--out DIR]

1. fp8 engines: `loopspec convert quantize --precision fp8` (built-in calibration prompts) into --out,
   reused when --out already holds them; fp32 engines: the runtime's first-use export cache.
2. The first prompt of each eval set (one per domain; the built-in sets, or DIR/NAME.jsonl files),
   greedy, --max-new-tokens tokens, adaptive fallback off (every round drafts): ar, dflash and dloop
   (the drafter's tuned setting) on both.
3. Prints τ per method and precision, its relative drop, and whether every output equals ar's
   (verification keeps it exact whatever the drafter's precision); writes fp8_drop.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = ("mt-bench", "alpaca", "humaneval", "mbpp", "math500")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--eval-dir", default=None, help="read the sets from DIR/NAME.jsonl files (default: the built-in sets by name)"
    )
    parser.add_argument("--out", default=str(ROOT / "build" / "fp8-default"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=1024)
    args = parser.parse_args()

    from loopspec.convert.quantize import REPORT, format_quantize_report, quantize_pair
    from loopspec.runtime.bench import load_prompts
    from loopspec.runtime.pipeline import load_pipeline

    out = Path(args.out)
    if not (out / REPORT).is_file():
        print(
            format_quantize_report(
                quantize_pair(target="default", drafter="default", out_dir=out, precision="fp8"), out
            )
        )
    pipes = {
        "fp32": load_pipeline(backend="onnxruntime", max_context=args.max_context),
        "fp8": load_pipeline(backend="onnxruntime", onnx_dir=out / "onnx", max_context=args.max_context),
    }
    sources = [Path(args.eval_dir) / f"{name}.jsonl" if args.eval_dir else name for name in SETS]
    prompts = [load_prompts(source, limit=1)[0] for source in sources]
    rows, identical = {}, True
    for name, text in zip(SETS, prompts):
        ids = pipes["fp32"].encode(text)
        ar = pipes["fp32"].run(ids, pipes["fp32"].settings("ar"), max_new_tokens=args.max_new_tokens).tokens
        for precision, pipe in pipes.items():
            for method in ("dflash", "dloop"):
                result = pipe.run(ids, pipe.settings(method, adaptive=False), max_new_tokens=args.max_new_tokens)
                same = result.tokens == ar
                identical &= same
                row = rows.setdefault(
                    (method, precision),
                    {"committed": 0, "verifications": 0, "seconds": 0.0, "tokens": 0, "per_prompt_tau": {}},
                )
                drafted = result.stats.counted_rounds()  # the verifications τ counts
                row["committed"] += sum(drafted)
                row["verifications"] += len(drafted)
                row["seconds"] += result.stats.total_s
                row["tokens"] += result.stats.new_tokens
                row["per_prompt_tau"][name] = round(result.stats.acceptance_length, 3)
                print(
                    f"{name:<10} {method:<7} {precision:<5} tau {result.stats.acceptance_length:5.2f}  "
                    f"{'same as ar' if same else 'DIFFERENT FROM AR'}",
                    flush=True,
                )
    summary = {}
    print(f"\n{'method':<8}{'tau fp32':>10}{'tau fp8':>10}{'drop':>9}{'tok/s fp32':>12}{'tok/s fp8':>11}")
    for method in ("dflash", "dloop"):
        tau = {p: rows[(method, p)]["committed"] / rows[(method, p)]["verifications"] for p in pipes}
        speed = {p: rows[(method, p)]["tokens"] / rows[(method, p)]["seconds"] for p in pipes}
        drop = (tau["fp32"] - tau["fp8"]) / tau["fp32"]
        summary[method] = {
            "tau_fp32": round(tau["fp32"], 3),
            "tau_fp8": round(tau["fp8"], 3),
            "relative_drop": round(drop, 4),
            "tokens_per_s_fp32": round(speed["fp32"], 1),
            "tokens_per_s_fp8": round(speed["fp8"], 1),
            "per_prompt_tau": {p: rows[(method, p)]["per_prompt_tau"] for p in pipes},
        }
        print(
            f"{method:<8}{tau['fp32']:>10.3f}{tau['fp8']:>10.3f}{drop:>+9.1%}{speed['fp32']:>12.1f}{speed['fp8']:>11.1f}"
        )
    print(f"every output identical to ar: {identical}")
    result = {
        "prompts": dict(zip(SETS, prompts)),
        "max_new_tokens": args.max_new_tokens,
        "methods": summary,
        "identical_to_ar": identical,
    }
    (out / "fp8_drop.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
