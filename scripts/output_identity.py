"""The tokens the shipped methods decode on several engines, dumped to JSON, and two dumps compared:
the check that a change moved code and not outputs (run `dump` before the change and after it,
then `compare`). Greedy; the default pair; the built-in prompt sets.

    python scripts/output_identity.py dump before.json [--limit 3 --max-new-tokens 64]
    python scripts/output_identity.py compare before.json after.json [--json summary.json]
"""

import argparse
import json
import sys
import time

# (backend, precision, methods as bench names them)
ENGINES = [
    ("onnxruntime", "gguf-int8act", ["ar", "dflash", "dloop", "suffix", "dloop+tree4+suffix"]),
    ("onnxruntime", "fp32", ["ar", "dflash", "dloop", "suffix"]),
    ("torch", "fp32", ["ar", "dflash", "dloop", "dloop+tree8+suffix"]),
]
SETS = ["humaneval", "math500", "mt-bench"]


def dump(out: str, limit: int, max_new_tokens: int) -> int:
    from loopspec.method_names import method_variant
    from loopspec.runtime.bench import load_prompt_sets
    from loopspec.runtime.pipeline import load_pipeline

    tokens = {}
    sets = load_prompt_sets(SETS, limit)
    for backend, precision, methods in ENGINES:
        start = time.time()
        pipe = load_pipeline("default", "default", backend=backend, precision=precision)
        for name in methods:
            method, overrides = method_variant(name)
            settings = pipe.settings(method, **overrides)
            for dataset, prompts in sets.items():
                for i, text in enumerate(prompts):
                    result = pipe.run(pipe.encode(text), settings, max_new_tokens=max_new_tokens)
                    tokens[f"{backend}/{precision}/{name}/{dataset}/{i}"] = result.tokens
            print(backend, precision, settings.describe(), f"{time.time() - start:.0f} s", flush=True)
    with open(out, "w") as f:
        json.dump(tokens, f)
    return 0


def compare(before: str, after: str, summary: str | None) -> int:
    a, b = json.load(open(before)), json.load(open(after))
    engines: dict[str, list[int]] = {}
    for key, tokens in a.items():
        engine = "/".join(key.split("/")[:3])
        same = engines.setdefault(engine, [0, 0])
        same[0] += b.get(key) == tokens
        same[1] += 1
    identical = sum(s for s, _ in engines.values())
    result = {
        "identical": identical,
        "outputs": len(a),
        "tokens": sum(len(t) for t in a.values()),
        "missing_after": sorted(set(a) - set(b)),
        "per_run": {engine: f"{s}/{n}" for engine, (s, n) in sorted(engines.items())},
    }
    print(json.dumps(result, indent=1))
    if summary:
        with open(summary, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if identical == len(a) and not result["missing_after"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="decode and write every output's tokens")
    d.add_argument("out")
    d.add_argument("--limit", type=int, default=3, help="prompts per set")
    d.add_argument("--max-new-tokens", type=int, default=64)
    c = sub.add_parser("compare", help="compare two dumps (exit 1 where any output differs)")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--json", dest="summary", default=None)
    args = p.parse_args()
    if args.command == "dump":
        return dump(args.out, args.limit, args.max_new_tokens)
    return compare(args.before, args.after, args.summary)


if __name__ == "__main__":
    sys.exit(main())
