"""Load test of `loopspec serve` on loopback with the official openai client, beside llama-server.

For each method it starts `loopspec serve` (default pair unless --target/--drafter), then sends the
same R chat requests (greedy, streamed) at each concurrency level and reports completion tokens per
second of wall time and the requests' latency (mean, p50, p99). Every output must equal the same
request run alone: the first method at concurrency 1 (requests one after another) is the reference
for all runs, so the check also shows that speculative methods reproduce `ar`. Any error, missing
finish or differing text fails the run (exit code 1). Bounded: R requests x --max-tokens tokens per
level, a per-request timeout and an overall deadline.

The method `llama-server` (with --llama-server PATH, built by scripts/build_llama_server.sh) serves the
same GGUF with llama.cpp, one slot per request of the highest concurrency (-np), the same threads,
through its own chat endpoint: measured the same way, its text not compared (other arithmetic).
--plot FILE draws tokens/s and p99 latency against concurrency, one line per method. A method written
METHOD+budget serves METHOD with --step-costs FILE (the verification budget; `loopspec costs --out FILE`
measures the table). After each method, τ (drafting rounds) and tokens per verification over every round
are read from the server's metrics.

    python scripts/load_test.py --methods ar,dloop,llama-server --concurrency 1,4,8,16 \
        --backend onnxruntime --threads 2 --llama-server llamacpp/bin/llama-server --plot serve.png
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
    if method == LLAMA_SERVER:
        return start_llama_server(args, port)
    method, _, variant = method.partition("+")  # dloop+budget: with --step-costs (the verification budget)
    if variant and (variant != "budget" or not args.step_costs):
        raise SystemExit(f"unknown method variant +{variant} (+budget needs --step-costs FILE)")
    cmd = [
        sys.executable,
        "-m",
        "loopspec.cli",
        "serve",
        "--method",
        method,
        "--port",
        str(port),
        "--target",
        args.target,
        "--drafter",
        args.drafter,
        "--max-batch-size",
        str(args.max_batch_size),
        "--max-context",
        str(args.max_context),
        "--threads",
        str(args.threads),
        "--log-level",
        "warning",
        "--model-name",
        "model",
        "--backend",
        args.backend,
    ] + (["--step-costs", args.step_costs] if variant else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return wait_healthy(subprocess.Popen(cmd, env=env), port, "loopspec serve")


LLAMA_SERVER = "llama-server"


def start_llama_server(args, port: int) -> subprocess.Popen:
    """llama-server on the target's GGUF with a slot for every request of the highest level; on a CPU
    with AMX without llama.cpp's weight repacking (it crashes at load there)."""
    from loopspec.engines.llamacpp import llama_server_command
    from loopspec.weights import TargetSource

    gguf = TargetSource.of(args.target).require_gguf("the llama-server peer")
    slots = max(int(c) for c in args.concurrency.split(",") if c)
    cmd = llama_server_command(
        args.llama_server, gguf, threads=args.threads, context=args.max_context * slots, port=port, slots=slots
    )
    if " amx_tile" in open("/proc/cpuinfo").read():
        cmd.append("--no-repack")
    return wait_healthy(
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port, "llama-server"
    )


def wait_healthy(proc: subprocess.Popen, port: int, name: str) -> subprocess.Popen:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"{name} did not become healthy in 300 s")


async def one_request(client, prompt: str, max_tokens: int, gate: asyncio.Semaphore) -> dict:
    async with gate:
        t0 = time.perf_counter()
        first = None
        text, finish, usage, pieces = [], None, None, 0
        stream = await client.chat.completions.create(
            model="model",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    text.append(choice.delta.content)
                    pieces += 1
                if choice.finish_reason:
                    finish = choice.finish_reason
        end = time.perf_counter()
    # a server that reports no usage streams one token per piece (llama-server does)
    return {
        "text": "".join(text),
        "finish": finish,
        "tokens": usage.completion_tokens if usage else pieces,
        "latency_s": end - t0,
        "ttft_s": (first or end) - t0,
    }


async def run_level(url: str, prompts: list[str], max_tokens: int, concurrency: int, timeout: float) -> dict:
    import httpx
    import openai

    # a connection per request, for every server alike: llama-server closes a kept-alive connection after a
    # few requests, and a request sent on it as it closes failed with a connection error (no retries here)
    fresh = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=timeout)
    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout, http_client=fresh
    )
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(client, p, max_tokens, gate) for p in prompts), return_exceptions=True)
    wall = time.perf_counter() - t0
    await client.close()
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    tokens = sum(r["tokens"] for r in ok)
    latencies = sorted(r["latency_s"] for r in ok) or [float("nan")]
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "mean_latency_s": sum(r["latency_s"] for r in ok) / max(1, len(ok)),
        "p50_latency_s": percentile(latencies, 50),
        "p99_latency_s": percentile(latencies, 99),
        "mean_ttft_s": sum(r["ttft_s"] for r in ok) / max(1, len(ok)),
        "errors": errors,
        "results": [None if isinstance(r, BaseException) else r for r in results],
    }


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted values, linear between the nearest ranks."""
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows if "concurrency" in r):
        points = [r for r in rows if r["method"] == method and "concurrency" in r]
        levels = [r["concurrency"] for r in points]
        speed.plot(levels, [r["tokens_per_s"] for r in points], marker="o", label=method)
        latency.plot(levels, [r["p99_latency_s"] for r in points], marker="o", label=method)
    speed.set(xlabel="concurrent requests", ylabel="completion tokens/s (all requests)", xscale="log", xticks=levels)
    latency.set(xlabel="concurrent requests", ylabel="p99 request latency (s)", xscale="log", xticks=levels)
    for axis in (speed, latency):
        axis.set_xticklabels([str(c) for c in levels])
        axis.grid(alpha=0.3)
    speed.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def acceptance(url: str) -> dict:
    """τ over the drafting rounds and tokens per verification over every round, from the server's metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()

    def value(pattern):
        found = re.search(pattern, text, re.M)
        return float(found.group(1)) if found else 0.0

    tau_sum, tau_count = (
        value(r"^loopspec_acceptance_length_sum (\S+)$"),
        value(r"^loopspec_acceptance_length_count (\S+)$"),
    )
    drafting = value(r'^loopspec_verifications_total\{kind="drafting"\} (\S+)$')
    plain = value(r'^loopspec_verifications_total\{kind="plain"\} (\S+)$')
    tokens = value(r"^loopspec_verified_tokens_total (\S+)$")
    return {
        "mean_tau": tau_sum / tau_count if tau_count else None,
        "tokens_per_verification": tokens / (drafting + plain) if drafting + plain else None,
        "plain_verifications": int(plain),
        "verifications": int(drafting + plain),
    }


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
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server, for the method llama-server")
    p.add_argument("--plot", default=None, help="a PNG of tokens/s and p99 latency per concurrency")
    p.add_argument(
        "--step-costs",
        default=None,
        help="a `loopspec costs --out` table: a method written METHOD+budget serves with it (the "
        "verification budget); METHOD alone with the timing fallback, unless a table is stored",
    )
    args = p.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    if LLAMA_SERVER in methods and not args.llama_server:
        raise SystemExit("the method llama-server needs --llama-server PATH")
    if methods[0] == LLAMA_SERVER:
        raise SystemExit("the first method is the reference: put a loopspec method first")
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if levels[0] != 1:
        raise SystemExit("--concurrency must start with 1: requests alone are the reference")
    prompts = (PROMPTS * (args.requests // len(PROMPTS) + 1))[: args.requests]
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
                run = asyncio.run(asyncio.wait_for(run_level(url, prompts, args.max_tokens, level, args.timeout), left))
                texts = [r["text"] if r else None for r in run["results"]]
                if reference is None:
                    reference = texts
                compared = method != LLAMA_SERVER  # llama.cpp's arithmetic gives other text at places
                bad = [
                    i
                    for i, r in enumerate(run["results"])
                    if r is None or r["finish"] not in ("stop", "length") or (compared and r["text"] != reference[i])
                ]
                failures += [f"{method} c={level}: {e}" for e in run["errors"]]
                failures += [f"{method} c={level}: request {i} differs from alone or did not finish" for i in bad]
                rows.append(
                    {"method": method, **{k: v for k, v in run.items() if k != "results"}, "equal_to_alone": not bad}
                )
                print(
                    f"{method:>12} c={level:<3} {run['tokens']:5d} tokens in {run['wall_s']:6.1f} s = "
                    f"{run['tokens_per_s']:6.1f} tok/s | latency mean {run['mean_latency_s']:5.1f} s, p50 "
                    f"{run['p50_latency_s']:5.1f} s, p99 {run['p99_latency_s']:5.1f} s, "
                    f"ttft {run['mean_ttft_s']:5.2f} s | errors {len(run['errors'])} "
                    f"| equal to alone: {not bad if compared else 'not compared'}",
                    flush=True,
                )
            if method != LLAMA_SERVER:
                seen = acceptance(url)
                rows.append({"method": method, **seen})
                if seen["verifications"]:
                    print(
                        f"{method:>12} over the run: tau {seen['mean_tau'] or 1:.2f} (drafting rounds), "
                        f"{seen['tokens_per_verification']:.2f} tokens/verification over all "
                        f"{seen['verifications']} ({seen['plain_verifications']} plain)"
                    )
        finally:
            server.terminate()
            server.wait(30)
    if args.json_out:
        from loopspec.runtime.bench.run import cpu_description

        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu_description(), "rows": rows, "failures": failures}, f, indent=2)
    if args.plot:
        plot(
            rows,
            args.plot,
            f"{args.requests} greedy chat requests of {args.max_tokens} tokens per level; "
            f"{args.threads} threads; backend {args.backend}",
        )
    for line in failures:
        print("FAIL", line)
    print("OK: no errors, every output equal to the request alone" if not failures else f"{len(failures)} failures")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
