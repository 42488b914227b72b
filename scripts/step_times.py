"""The target's step on an engine, in ms, over a grid: k new tokens on one row (k = 1, 2, 4, 8, 16)
and one token on each of 1 / 4 / 8 / 16 rows, at each context length (256 and 1024 positions by
default), then the prefill of a long prompt (tokens/s). Median of repeated calls, each rolled back,
so every call sees the same context. Run it with nothing else on the machine.

    python scripts/step_times.py [--precision gguf-int8act] [--threads 2] [--calls 40] \
        [--contexts 256,1024] [--chains 1,2,4,8,16] [--rows 1,4,8,16] [--json FILE]

The JSON holds one record per measured point: {"k": new tokens per row, "rows": rows, "context":
positions already in each row's cache, "ms": median step}; rows of a multi-row point sit at contexts
spread over the 10 % below the nominal one, as a server's rows do.
"""

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from loopspec.runtime.bench.step_runs import integers, reserve_json, run_record, write_json
from loopspec.runtime.pipeline import load_pipeline

VOCAB = 49152


def median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--precision", default="gguf-int8act")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--contexts", type=integers, default=[256, 1024])
    p.add_argument("--chains", type=integers, default=[1, 2, 4, 8, 16])
    p.add_argument("--rows", type=integers, default=[1, 4, 8, 16])
    p.add_argument("--prefill-tokens", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    reserve_json(args.json)
    pipe = load_pipeline("default", "default", backend="onnxruntime", precision=args.precision,
                         num_threads=args.threads, max_context=max(args.contexts + [args.prefill_tokens]) + 32)
    engine = pipe.engine.with_rows(max(args.rows))
    g = torch.Generator().manual_seed(0)
    result = run_record(pipe.engine_name, args.threads, args.calls)
    points = len(args.contexts) * (len(args.chains) + len(args.rows))
    progress = tqdm(total=points, desc="step times", unit="point")
    for context in args.contexts:
        lengths = torch.linspace(int(context * 0.9), context, max(args.rows)).long().tolist()[::-1]
        for row, n in enumerate(lengths):  # row 0 at the nominal context
            engine.prefill(row, torch.randint(0, VOCAB, (n,), generator=g).tolist(), want_taps=False)

        def step(tokens: list[list[int]]):
            def call():
                engine.verify(tokens, want_taps=False)
                engine.target_rollback(lengths[:len(tokens)])
            return call

        for k in args.chains:
            ms = median_ms(step([list(range(1, k + 1))]), args.calls)
            result["steps"].append({"k": k, "rows": 1, "context": lengths[0], "ms": round(ms, 2)})
            progress.update()
        for rows in args.rows:
            if rows == 1 and 1 in args.chains:  # the one-token, one-row point is measured above
                progress.update()
                continue
            ms = median_ms(step([[1]] * rows), args.calls)
            result["steps"].append({"k": 1, "rows": rows, "context": lengths[0], "ms": round(ms, 2)})
            progress.update()
    progress.close()
    prompt = torch.randint(0, VOCAB, (args.prefill_tokens,), generator=g).tolist()
    start = time.perf_counter()
    engine.prefill(0, prompt, want_taps=False)
    result["prefill"] = {"tokens": args.prefill_tokens,
                         "tokens_per_s": round(args.prefill_tokens / (time.perf_counter() - start), 1)}
    for s in result["steps"]:
        print(f"k {s['k']:2d} x {s['rows']:2d} rows at {s['context']:5d} positions: {s['ms']:7.2f} ms")
    print(f"prefill of {args.prefill_tokens} tokens: {result['prefill']['tokens_per_s']} tokens/s")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
