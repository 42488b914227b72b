"""Load test of `loopspec serve` on loopback with the official openai client.

For each method it starts `loopspec serve` (default pair unless --target/--drafter), then sends the
same R chat requests (greedy, streamed) at each concurrency level and reports completion tokens per
second of wall time. Every output must equal the same request run alone: the first method at
concurrency 1 (requests one after another) is the reference for all runs, so the check also shows
that speculative methods reproduce `ar`. Any error, missing finish or differing text fails the run
(exit code 1). Bounded: R requests x --max-tokens tokens per level, a per-request timeout and an
overall deadline.

    OMP_NUM_THREADS=1 python scripts/load_test.py --methods ar,dloop --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clean Python code.",
    "Explain what a hash table is.",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List five fruits that are red.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about autumn leaves.",
    "Why is the sky blue?",
    "Explain recursion to a child.",
    "What are the primary colors?",
    "Write a SQL query that counts rows in a table named users.",
    "Give two reasons to learn a second language.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, method: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loopspec.cli", "serve", "--method", method, "--port", str(port),
           "--target", args.target, "--drafter", args.drafter, "--max-batch-size", str(args.max_batch_size),
           "--max-context", str(args.max_context), "--threads", str(args.threads), "--log-level", "warning",
           "--model-name", "model", "--backend", args.backend]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"loopspec serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("loopspec serve did not become healthy in 300 s")


async def one_request(client, prompt: str, max_tokens: int, gate: asyncio.Semaphore) -> dict:
    async with gate:
        t0 = time.perf_counter()
        first = None
        text, finish, usage = [], None, None
        stream = await client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    text.append(choice.delta.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
        end = time.perf_counter()
    return {"text": "".join(text), "finish": finish, "tokens": usage.completion_tokens if usage else 0,
            "latency_s": end - t0, "ttft_s": (first or end) - t0}


async def run_level(url: str, prompts: list[str], max_tokens: int, concurrency: int, timeout: float) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(client, p, max_tokens, gate) for p in prompts), return_exceptions=True)
    wall = time.perf_counter() - t0
    await client.close()
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "mean_latency_s": sum(r["latency_s"] for r in ok) / max(1, len(ok)),
            "mean_ttft_s": sum(r["ttft_s"] for r in ok) / max(1, len(ok)),
            "errors": errors, "results": [None if isinstance(r, BaseException) else r for r in results]}


def mean_tau(url: str) -> float | None:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = re.search(r"^loopspec_acceptance_length_sum (\S+)$", text, re.M)
    count = re.search(r"^loopspec_acceptance_length_count (\S+)$", text, re.M)
    return float(total.group(1)) / float(count.group(1)) if total and count and float(count.group(1)) else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,dloop")
    p.add_argument("--concurrency", default="1,4,16", help="levels; the first must be 1 (the reference)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="torch", help="torch or onnxruntime (both batch their rows)")
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--max-seconds", type=float, default=1800.0, help="the whole test")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if levels[0] != 1:
        raise SystemExit("--concurrency must start with 1: requests alone are the reference")
    prompts = (PROMPTS * (args.requests // len(PROMPTS) + 1))[:args.requests]
    deadline = time.monotonic() + args.max_seconds
    reference, rows, failures = None, [], []
    for method in methods:
        port = free_port()
        server = start_server(args, method, port)
        url = f"http://127.0.0.1:{port}"
        try:
            for level in levels:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit("the load test ran out of its --max-seconds")
                run = asyncio.run(asyncio.wait_for(
                    run_level(url, prompts, args.max_tokens, level, args.timeout), left))
                texts = [r["text"] if r else None for r in run["results"]]
                if reference is None:
                    reference = texts
                bad = [i for i, r in enumerate(run["results"])
                       if r is None or r["finish"] not in ("stop", "length") or r["text"] != reference[i]]
                failures += [f"{method} c={level}: {e}" for e in run["errors"]]
                failures += [f"{method} c={level}: request {i} differs from alone or did not finish" for i in bad]
                rows.append({"method": method, **{k: v for k, v in run.items() if k != "results"},
                             "equal_to_alone": not bad})
                print(f"{method:>6} c={level:<3} {run['tokens']:5d} tokens in {run['wall_s']:6.1f} s = "
                      f"{run['tokens_per_s']:6.1f} tok/s | latency {run['mean_latency_s']:5.1f} s, "
                      f"ttft {run['mean_ttft_s']:5.2f} s | errors {len(run['errors'])} | equal to alone: {not bad}",
                      flush=True)
            tau = mean_tau(url)
            if tau is not None:
                rows.append({"method": method, "mean_tau": tau})
                print(f"{method:>6} mean tau over the run: {tau:.2f}")
        finally:
            server.terminate()
            server.wait(30)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "failures": failures}, f, indent=2)
    for line in failures:
        print("FAIL", line)
    print("OK: no errors, every output equal to the request alone" if not failures else f"{len(failures)} failures")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
