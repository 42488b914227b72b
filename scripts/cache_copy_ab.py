"""A/B of the default engine's target step in one process: the cache as a static buffer of the
maximum context, whose past is copied into a dense block every call, against the cache whose buffer
follows the rows (`SlotGrowth`), passed to ONNX Runtime as it is. Calls alternate between the two on
the same rows; every pair of calls must return the same logits. Run it with nothing else on the machine.

    python scripts/cache_copy_ab.py [--threads 2] [--calls 40] [--contexts 256,1024] \
        [--chains 1,4,8] [--rows 4,8,16] [--json FILE]

The JSON holds one record per point: {"k", "rows", "context", "copied_ms", "grown_ms"} (medians).
"""

import argparse

import torch
from tqdm import tqdm

from loopspec.model.kv_cache import KVCache
from loopspec.runtime.bench.step_runs import alternating_steps, integers, reserve_json, run_record, write_json
from loopspec.runtime.pipeline import load_pipeline

VOCAB = 49152


def static_twin(engine, rows: int):
    """The engine with a static cache of the maximum context: the past of every call is a strided
    view of it, copied into a dense block before the call (the layout before SlotGrowth)."""
    twin = engine.with_rows(rows)
    t = twin.target_cfg
    twin.cache = KVCache(t.num_layers, rows, t.num_kv_heads, twin.max_context, t.head_dim)
    return twin


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--contexts", type=integers, default=[256, 1024])
    p.add_argument("--chains", type=integers, default=[1, 4, 8])
    p.add_argument("--rows", type=integers, default=[4, 8, 16])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    reserve_json(args.json)
    pipe = load_pipeline(
        "default",
        "default",
        backend="onnxruntime",
        precision="gguf-int8act",
        num_threads=args.threads,
        max_context=max(args.contexts) + 32,
    )
    most = max(args.rows + [1])
    engines = {"copied": static_twin(pipe.engine, most), "grown": pipe.engine.with_rows(most)}
    g = torch.Generator().manual_seed(0)
    result = run_record(pipe.engine_name, args.threads, args.calls, max_context=engines["grown"].max_context)
    points = [(k, 1) for k in args.chains] + [(1, r) for r in args.rows]
    progress = tqdm(total=len(args.contexts) * len(points), desc="cache copy A/B", unit="point")
    for context in args.contexts:
        lengths = torch.linspace(int(context * 0.9), context, most).long().tolist()[::-1]
        prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
        for engine in engines.values():
            for row, prompt in enumerate(prompts):
                engine.prefill(row, prompt, want_taps=False)
        for k, rows in points:
            medians, same = alternating_steps(engines, [list(range(1, k + 1))] * rows, lengths, args.calls)
            if not same:
                raise SystemExit(f"logits differ at k {k}, {rows} rows, context {context}")
            result["steps"].append(
                {"k": k, "rows": rows, "context": lengths[0], **{f"{name}_ms": ms for name, ms in medians.items()}}
            )
            progress.update()
    progress.close()
    for s in result["steps"]:
        print(
            f"k {s['k']:2d} x {s['rows']:2d} rows at {s['context']:5d} positions: copied {s['copied_ms']:7.2f} ms, "
            f"grown {s['grown_ms']:7.2f} ms ({s['copied_ms'] / s['grown_ms']:.2f}x)"
        )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
