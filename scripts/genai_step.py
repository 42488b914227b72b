"""ONNX Runtime GenAI's decode step on the same prompts as loopspec's engines: the ceiling its own
int4 model builder reaches on this CPU, timed beside `scripts/step_times.py`. Two steps, because
onnxruntime-genai is not a loopspec dependency (install it in a virtual environment of its own, with
torch and transformers for its builder):

    # 1. in loopspec's environment: the prompts as token ids (chat template), in a JSON file
    python scripts/genai_step.py --write-ids ids.json --prompts humaneval --limit 8
    # 2. in the GenAI environment: build the int4 model from the default target's fp32 checkpoint
    #    (the directory `loopspec generate` caches, printed by step 1), then time it
    python -m onnxruntime_genai.models.builder -i TARGET_DIR -o genai-int4 -p int4 -e cpu -c genai-cache
    python scripts/genai_step.py --model genai-int4 --ids ids.json --max-new-tokens 128

Greedy, on `--threads` intra-op threads (default 2, as loopspec's engines: GenAI's own default took
one thread on a 2-core Intel Xeon, 20.4 against 12.0 ms a step); one uncounted warm-up prompt; the median of every
decode step (the first token after the prompt excluded) and the median prefill. With `--curve`, the
step curve as `scripts/step_times.py` measures ours: k tokens appended to one sequence at each
context length, their logits read, then rewound (`append_tokens` + `get_output("logits")` +
`rewind_to`), median of `--calls`. `--json FILE` writes every figure.
"""

import argparse
import json
import statistics
import sys
import time


def write_ids(path: str, prompts: list[str], limit: int) -> None:
    from loopspec.runtime.bench import load_prompt_sets
    from loopspec.runtime.pipeline import load_pipeline

    pipe = load_pipeline("default", None, backend="torch")
    ids = [pipe.encode(t) for texts in load_prompt_sets(prompts, limit).values() for t in texts]
    with open(path, "w") as f:
        json.dump(ids, f)
    print(f"{len(ids)} prompts → {path}; the target's checkpoint: {pipe.target_dir}")


def step_curve(model, contexts: list[int], chains: list[int], calls: int) -> list[dict]:
    """[{k, rows: 1, context, ms}]: the median time of appending k tokens at `context` positions and
    reading their logits, rewound after each call so every call sees the same context."""
    import onnxruntime_genai as og

    records = []
    for context in contexts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=context + max(chains) + 1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([(7 * i) % 40000 + 100 for i in range(context)])
        for k in chains:
            times = []
            for _ in range(calls + 1):  # the first call uncounted: warm-up
                start = time.perf_counter()
                generator.append_tokens(list(range(200, 200 + k)))
                generator.get_output("logits")
                times.append((time.perf_counter() - start) * 1e3)
                generator.rewind_to(context)
            records.append({"k": k, "rows": 1, "context": context, "ms": round(statistics.median(times[1:]), 2)})
            print(f"onnxruntime-genai: k {k:2d} at {context:5d} positions: {records[-1]['ms']:.2f} ms", flush=True)
    return records


def with_threads(model_dir: str, threads: int, scratch: str) -> str:
    """The model directory with its decoder's session set to `threads` intra-op threads: a copy of its
    genai_config.json beside links to its other files, in `scratch`."""
    import os

    for name in os.listdir(model_dir):
        if name != "genai_config.json":
            os.symlink(os.path.join(os.path.abspath(model_dir), name), os.path.join(scratch, name))
    with open(os.path.join(model_dir, "genai_config.json")) as f:
        config = json.load(f)
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    with open(os.path.join(scratch, "genai_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return scratch


def time_genai(model_dir: str, ids_path: str, max_new_tokens: int) -> dict:
    import onnxruntime_genai as og

    model = og.Model(model_dir)
    prompts = json.load(open(ids_path))
    steps, prefills = [], []
    for i, ids in enumerate([prompts[0]] + prompts):  # the first once more, uncounted: warm-up
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(ids)  # the prompt's forward
        prefill = time.perf_counter() - start
        times = []
        while not generator.is_done() and len(times) < max_new_tokens:
            start = time.perf_counter()
            generator.generate_next_token()
            times.append((time.perf_counter() - start) * 1e3)
        if i:
            steps += times[1:]
            prefills.append(prefill)
    print(
        f"onnxruntime-genai {getattr(og, '__version__', '?')}: decode step median {statistics.median(steps):.2f} ms "
        f"({len(steps)} steps, {len(prompts)} prompts), prefill median {statistics.median(prefills) * 1e3:.0f} ms"
    )
    return {
        "version": getattr(og, "__version__", "?"),
        "decode_step_ms": round(statistics.median(steps), 2),
        "decode_steps": len(steps),
        "prompts": len(prompts),
        "prefill_ms": round(statistics.median(prefills) * 1e3, 1),
        "model": model,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--write-ids", metavar="FILE", help="write the prompts' token ids (loopspec's environment)")
    p.add_argument("--prompts", nargs="+", default=["humaneval"])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--model", help="a GenAI model directory (its builder's output)")
    p.add_argument("--ids", help="the token ids --write-ids wrote")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--curve", action="store_true", help="also the step curve (k tokens at each context)")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--chains", default="1,2,4,8,16")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--threads", type=int, default=2, help="GenAI's intra-op threads (default 2)")
    p.add_argument("--json", metavar="FILE", help="write the figures here")
    args = p.parse_args()
    if args.json:
        open(args.json, "a").close()  # an unwritable path fails now, not after the run
    if args.write_ids:
        write_ids(args.write_ids, args.prompts, args.limit)
    elif args.model and args.ids:
        import tempfile

        scratch = tempfile.TemporaryDirectory()
        result = time_genai(with_threads(args.model, args.threads, scratch.name), args.ids, args.max_new_tokens)
        result["threads"] = args.threads
        model = result.pop("model")
        if args.curve:
            result["steps"] = step_curve(
                model, [int(c) for c in args.contexts.split(",")], [int(k) for k in args.chains.split(",")], args.calls
            )
        if args.json:
            from datetime import datetime, timezone

            try:
                from loopspec.runtime.bench.run import cpu_description  # loopspec beside GenAI: the CPU, named

                result["cpu"] = cpu_description()
            except ImportError:  # GenAI's environment alone: scripts/step_times.py, its caller, names the CPU
                pass
            result["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    else:
        p.error("give --write-ids FILE, or --model DIR and --ids FILE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
