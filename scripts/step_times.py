"""The target's step on an engine, in ms, over a grid: k new tokens on one row (k = 1, 2, 4, 8, 16)
and one token on each of 1 / 4 / 8 / 16 rows, at each context length (256 and 1024 positions by
default), then the prefill of a long prompt (tokens/s). Median of repeated calls, each rolled back,
so every call sees the same context. Run it with nothing else on the machine.

    python scripts/step_times.py [--target default|FILE.gguf|DIR] [--precision gguf-int8act] [--threads 2] \
        [--calls 40] [--contexts 256,1024] [--chains 1,2,4,8,16] [--rows 1,4,8,16] [--json FILE] \
        [--llama-bench PATH] [--genai-python PY --genai-model DIR]

`--target`: the target whose step is measured (default: the embedded SmolLM2 GGUF, with its shipped
drafter loaded as a decode would); any other target loads no drafter, which the target's step does
not call.

The JSON holds one record per measured point: {"k": new tokens per row, "rows": rows, "context":
positions already in each row's cache, "ms": median step}, and on an engine with a step graph
(gguf-fused) "bare_ms" for one row: its session alone on the same feeds, the engine's own cost
being the difference; rows of a multi-row point sit at contexts
spread over the 10 % below the nominal one, as a server's rows do.

Peers in the same run, before loopspec's grid (neither is a dependency), each under "peers" in the
JSON with the same fields for one row: `--llama-bench` (llama.cpp's, built by
scripts/build_llama_server.sh) on the target's GGUF — k = 1 from its token-generation test at each
depth, k > 1 from its prompt test of k tokens at that depth (-p k -n 0 -d context), with `--repack 0`
where this CPU has AMX (llama.cpp's AMX repacking crashes at load here); `--genai-python` /
`--genai-model`: ONNX Runtime GenAI's int4 build (its builder's output directory), timed by
scripts/genai_step.py --curve in the Python of its own environment.
"""

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from loopspec.runtime.bench.step_runs import integers, reserve_json, run_record, write_json
from loopspec.runtime.pipeline import load_pipeline


def median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def bare_step(engine, k: int):
    """The one-row step graph's session alone on the feeds of a k-token call (the binding the engine's
    calls keep: the cache's own buffers; the same ids, lengths and logit rows bound here once): the
    call without the engine around it. Row 0's length stays where it is, so every run writes the
    same slots."""
    import numpy as np

    from loopspec.engines.target_step import gqa_lengths

    session = engine.step.sessions[1]
    binding = next(b for key, b in engine.step.bindings.items() if key[:2] == (1, 0))
    feeds = {"input_ids": np.arange(1, k + 1, dtype=np.int64)[None], "logit_index": np.arange(k, dtype=np.int64)}
    feeds["seqlens_k"], feeds["total_sequence_length"] = gqa_lengths(engine.cache.lengths[:1].numpy(), k)
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    return lambda: session.run_with_iobinding(binding)


def cpu_has_amx() -> bool:
    return " amx_tile" in Path("/proc/cpuinfo").read_text()


def llama_bench_curve(
    binary: str, gguf: str, threads: int, contexts: list[int], chains: list[int], repetitions: int
) -> dict:
    """llama-bench's step at each context: k = 1 from a 16-token generation test (ms per token), k > 1
    from a k-token prompt test (ms per batch), both at that depth."""
    batches = [k for k in chains if k > 1]
    command = [
        binary,
        "-m",
        gguf,
        "-t",
        str(threads),
        "-r",
        str(repetitions),
        "-o",
        "json",
        "-d",
        ",".join(map(str, contexts)),
        "-p",
        ",".join(map(str, batches or [0])),
        "-n",
        "16",
    ]
    if cpu_has_amx():
        command += ["--repack", "0"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    steps = []
    for test in json.loads(out):
        n_prompt, n_gen, depth, per_s = test["n_prompt"], test["n_gen"], test["n_depth"], test["avg_ts"]
        if n_gen == 0 and n_prompt in batches:
            steps.append({"k": n_prompt, "rows": 1, "context": depth, "ms": round(1000 * n_prompt / per_s, 2)})
        elif n_prompt == 0 and n_gen > 0 and 1 in chains:
            steps.append({"k": 1, "rows": 1, "context": depth, "ms": round(1000 / per_s, 2)})
    build = json.loads(out)[0]
    return {
        "command": " ".join(command),
        "build": f"{build.get('build_commit', '?')} ({build.get('build_number', '?')})",
        "steps": sorted(steps, key=lambda s: (s["context"], s["k"])),
    }


def genai_curve(python: str, model: str, threads: int, contexts: list[int], chains: list[int], calls: int) -> dict:
    """scripts/genai_step.py --curve in GenAI's own environment → its JSON (version, steps)."""
    script = Path(__file__).with_name("genai_step.py")
    with tempfile.TemporaryDirectory() as tmp:
        ids, out = Path(tmp) / "ids.json", Path(tmp) / "genai.json"
        ids.write_text(json.dumps([[100 + i for i in range(32)]]))  # one short prompt: its warm-up
        subprocess.run(
            [
                python,
                str(script),
                "--model",
                model,
                "--ids",
                str(ids),
                "--max-new-tokens",
                "16",
                "--curve",
                "--contexts",
                ",".join(map(str, contexts)),
                "--chains",
                ",".join(map(str, chains)),
                "--calls",
                str(calls),
                "--threads",
                str(threads),
                "--json",
                str(out),
            ],
            check=True,
        )
        result = json.loads(out.read_text())
    return {"version": result.get("version"), "model": model, "threads": threads, "steps": result["steps"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--target", default="default", help="'default', a .gguf file or a checkpoint directory")
    p.add_argument("--precision", default="gguf-int8act")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--contexts", type=integers, default=[256, 1024])
    p.add_argument("--chains", type=integers, default=[1, 2, 4, 8, 16])
    p.add_argument("--rows", type=integers, default=[1, 4, 8, 16])
    p.add_argument("--prefill-tokens", type=int, default=2000)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--llama-bench", metavar="PATH", help="llama.cpp's llama-bench: its step on the target's GGUF, first"
    )
    p.add_argument("--genai-python", metavar="PY", help="the Python of an environment with onnxruntime-genai")
    p.add_argument("--genai-model", metavar="DIR", help="GenAI's int4 build of the target (its builder's output)")
    args = p.parse_args()
    if (args.genai_python is None) != (args.genai_model is None):
        p.error("--genai-python and --genai-model go together")
    reserve_json(args.json)
    # the peers first, each in a process of its own that has ended before loopspec's engine loads (an
    # engine's idle pool threads, or llama.cpp's, would take the cores from whatever runs beside them)
    peers = {}
    if args.llama_bench:
        from loopspec.weights import TargetSource

        gguf = TargetSource.of(args.target).require_gguf("--llama-bench")
        peers["llama.cpp"] = llama_bench_curve(
            args.llama_bench, str(gguf), args.threads, args.contexts, args.chains, repetitions=5
        )
    if args.genai_python:
        peers["onnxruntime-genai"] = genai_curve(
            args.genai_python, args.genai_model, args.threads, args.contexts, args.chains, args.calls
        )
    pipe = load_pipeline(
        args.target,
        "default" if args.target == "default" else "none",
        backend="onnxruntime",
        precision=args.precision,
        num_threads=args.threads,
        max_context=max(args.contexts + [args.prefill_tokens]) + 32,
    )
    engine = pipe.engine.with_rows(max(args.rows))
    vocab = engine.target_cfg.vocab_size  # random prompt ids: the step's time does not depend on them
    g = torch.Generator().manual_seed(0)
    result = run_record(pipe.engine_name, args.threads, args.calls, target=args.target)
    points = len(args.contexts) * (len(args.chains) + len(args.rows))
    progress = tqdm(total=points, desc="step times", unit="point")
    for context in args.contexts:
        lengths = torch.linspace(int(context * 0.9), context, max(args.rows)).long().tolist()[::-1]
        for row, n in enumerate(lengths):  # row 0 at the nominal context
            engine.prefill(row, torch.randint(0, vocab, (n,), generator=g).tolist(), want_taps=False)

        def step(tokens: list[list[int]]):
            def call():
                engine.verify(tokens, want_taps=False)
                engine.target_rollback(lengths[: len(tokens)])

            return call

        for k in args.chains:
            ms = median_ms(step([list(range(1, k + 1))]), args.calls)
            point = {"k": k, "rows": 1, "context": lengths[0], "ms": round(ms, 2)}
            if engine.step is not None:  # the step graph's session alone, on the feeds the engine's call bound
                point["bare_ms"] = round(median_ms(bare_step(engine, k), args.calls), 2)
            result["steps"].append(point)
            progress.update()
        for rows in args.rows:
            if rows == 1 and 1 in args.chains:  # the one-token, one-row point is measured above
                progress.update()
                continue
            ms = median_ms(step([[1]] * rows), args.calls)
            result["steps"].append({"k": 1, "rows": rows, "context": lengths[0], "ms": round(ms, 2)})
            progress.update()
    progress.close()
    prompt = torch.randint(0, vocab, (args.prefill_tokens,), generator=g).tolist()
    start = time.perf_counter()
    engine.prefill(0, prompt, want_taps=False)
    result["prefill"] = {
        "tokens": args.prefill_tokens,
        "tokens_per_s": round(args.prefill_tokens / (time.perf_counter() - start), 1),
    }
    for s in result["steps"]:
        bare = f" (its session alone: {s['bare_ms']:.2f} ms)" if "bare_ms" in s else ""
        print(f"k {s['k']:2d} x {s['rows']:2d} rows at {s['context']:5d} positions: {s['ms']:7.2f} ms{bare}")
    print(f"prefill of {args.prefill_tokens} tokens: {result['prefill']['tokens_per_s']} tokens/s")
    result["peers"] = peers
    for name, peer in peers.items():
        for s in peer["steps"]:
            print(f"{name}: k {s['k']:2d} at {s['context']:5d} positions: {s['ms']:7.2f} ms")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
