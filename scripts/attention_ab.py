"""A/B of the default engine's target step in one process: the order-free attention (ours, ~25 small
nodes a layer; verifies draft trees) against ONNX Runtime's GroupQueryAttention (one kernel a layer,
engines/fused_attention.py; chains only, and a lone token padded to two where this CPU's one-token
kernel differs). Calls alternate between the two on the same rows. Also checks, on the fused engine,
that a chain of 8 verified at once gives the logits of the same 8 tokens one by one. Run it with
nothing else on the machine.

    python scripts/attention_ab.py [--threads 2] [--calls 40] [--contexts 256,1024] [--chains 1,2,4,8] \
        [--rows 4,16] [--json FILE]

The JSON holds one record per point: {"k", "rows", "context", "order_free_ms", "fused_ms"} (medians).
"""

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from loopspec.engines.backends import cached_onnx_engine
from loopspec.pair import load_pair
from loopspec.runtime.bench.step_runs import integers, reserve_json, run_record, write_json
from loopspec.runtime.pipeline import TargetSource

VOCAB = 49152


def chain_equals_steps(engine, generator) -> bool:
    context = torch.randint(0, VOCAB, (300,), generator=generator).tolist()
    tokens = torch.randint(0, VOCAB, (8,), generator=generator).tolist()
    engine.prefill(0, context, want_taps=False)
    chain, _ = engine.verify([tokens], want_taps=False)
    engine.target_rollback([len(context)])
    steps = [engine.verify([[t]], want_taps=False)[0][0, 0] for t in tokens]
    engine.target_rollback([0])
    return all(torch.equal(chain[0, i], steps[i]) for i in range(len(tokens)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--contexts", type=integers, default=[256, 1024])
    p.add_argument("--chains", type=integers, default=[1, 2, 4, 8])
    p.add_argument("--rows", type=integers, default=[4, 16])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    reserve_json(args.json)
    pair = load_pair("default", "default")
    gguf = TargetSource.of("default").require_gguf("the GGUF block precisions")
    most = max(args.rows + [1])
    engines = {name: cached_onnx_engine(pair.target, pair.drafter, pair.target_dir, pair.drafter_dir,
                                        max(args.contexts) + 32, args.threads, "gguf-int8act", gguf,
                                        attention=attention).with_rows(most)
               for name, attention in (("order_free", "order-free"), ("fused", "fused"))}
    g = torch.Generator().manual_seed(0)
    result = run_record("onnxruntime gguf-int8act", args.threads, args.calls)
    result["fused_chain_equals_steps"] = chain_equals_steps(engines["fused"], g)
    result["lone_step_width"] = {name: engine.lone_step_width for name, engine in engines.items()}
    points = [(k, 1) for k in args.chains] + [(1, r) for r in args.rows]
    progress = tqdm(total=len(args.contexts) * len(points), desc="attention A/B", unit="point")
    for context in args.contexts:
        lengths = torch.linspace(int(context * 0.9), context, most).long().tolist()[::-1]
        prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
        for engine in engines.values():
            for row, prompt in enumerate(prompts):
                engine.prefill(row, prompt, want_taps=False)
        for k, rows in points:
            tokens = [list(range(1, k + 1))] * rows
            times = {name: [] for name in engines}
            for _ in range(args.calls):
                for name, engine in engines.items():
                    start = time.perf_counter()
                    engine.verify(tokens, want_taps=False)
                    engine.target_rollback(lengths[:rows])
                    times[name].append((time.perf_counter() - start) * 1000)
            result["steps"].append({"k": k, "rows": rows, "context": lengths[0],
                                    **{f"{name}_ms": round(statistics.median(t), 2) for name, t in times.items()}})
            progress.update()
    progress.close()
    print(f"fused: a chain of 8 at once equals the 8 tokens one by one: {result['fused_chain_equals_steps']}")
    for s in result["steps"]:
        print(f"k {s['k']:2d} x {s['rows']:2d} rows at {s['context']:5d} positions: order-free {s['order_free_ms']:7.2f} ms, "
              f"fused {s['fused_ms']:7.2f} ms ({s['order_free_ms'] / s['fused_ms']:.2f}x)")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
