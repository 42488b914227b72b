"""The target's step on an engine, in ms: one token a row at 1 / 4 / 8 / 16 rows, a chain of 4 and of
8 tokens on one row, and the prefill of a long prompt (tokens/s). Median of repeated calls, each
rolled back, so every call sees the same context. Run it with nothing else on the machine.

    python scripts/step_times.py [--precision gguf-int8act] [--threads 2] [--calls 60] [--json FILE]
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch

from loopspec.runtime.pipeline import load_pipeline

ROWS = (1, 4, 8, 16)
CHAINS = (4, 8)


def cpu_name() -> str:
    """The CPU's model name and its wide-vector features (the figures depend on them)."""
    info = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    model = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), [])
    features = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    return f"{model} ({', '.join(features) or 'no AVX2'}, {os.cpu_count()} cores)"


def median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="gguf-int8act")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--prefill-tokens", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    pipe = load_pipeline("default", "default", backend="onnxruntime", precision=args.precision,
                         num_threads=args.threads, max_context=4096)
    engine = pipe.engine.with_rows(max(ROWS))
    g = torch.Generator().manual_seed(0)
    # rows of different context lengths (100 .. 250), as a server's rows are
    lengths = torch.linspace(100, 250, max(ROWS)).long().tolist()
    for row, n in enumerate(lengths):
        engine.prefill(row, torch.randint(0, 49152, (n,), generator=g).tolist(), want_taps=False)
    result = {"engine": pipe.engine_name, "cpu": cpu_name(), "calls": args.calls}

    def one_token(rows: int):
        def call():
            engine.verify([[1]] * rows, want_taps=False)
            engine.target_rollback(lengths[:rows])
        return call

    def chain(width: int):
        def call():
            engine.verify([list(range(1, width + 1))], want_taps=False)
            engine.target_rollback(lengths[:1])
        return call

    for rows in ROWS:
        result[f"1 token x {rows} rows"] = round(median_ms(one_token(rows), args.calls), 2)
        print(f"1 token x {rows:2d} rows: {result[f'1 token x {rows} rows']:.2f} ms", flush=True)
    for width in CHAINS:
        result[f"{width}-token chain x 1 row"] = round(median_ms(chain(width), args.calls), 2)
        print(f"{width}-token chain x 1 row: {result[f'{width}-token chain x 1 row']:.2f} ms", flush=True)
    prompt = torch.randint(0, 49152, (args.prefill_tokens,), generator=g).tolist()
    start = time.perf_counter()
    engine.prefill(0, prompt, want_taps=False)
    result["prefill tokens/s"] = round(args.prefill_tokens / (time.perf_counter() - start), 1)
    print(f"prefill of {args.prefill_tokens} tokens: {result['prefill tokens/s']} tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
