"""A/B of the default engine's lone one-token step in one process: the token alone (a one-row
product) against the token followed by a padding token (what the engine runs where a one-row product
takes another kernel), at each context; calls alternate, and the JSON says whether the real token's
logits and K/V were the same bits both ways (the engine measures that at load: `lone_step_width`).
Run it with nothing else on the machine.

    python scripts/lone_step_ab.py [--threads 2] [--calls 60] [--contexts 256,1024] [--json FILE]
"""

import argparse
import statistics
import time

import torch

from loopspec.engines.specs import MIN_PRODUCT_ROWS
from loopspec.runtime.bench.step_runs import integers, reserve_json, run_record, write_json
from loopspec.runtime.pipeline import load_pipeline

VOCAB = 49152


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--contexts", type=integers, default=[256, 1024])
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
    engine = pipe.engine
    g = torch.Generator().manual_seed(0)
    result = run_record(pipe.engine_name, args.threads, args.calls, lone_step_width=engine.lone_step_width)
    for context in args.contexts:
        engine.prefill(0, torch.randint(0, VOCAB, (context,), generator=g).tolist(), want_taps=False)
        times, same = {1: [], MIN_PRODUCT_ROWS: []}, True
        for _ in range(args.calls):
            token = [torch.randint(0, VOCAB, (1,), generator=g).tolist()]
            out = {}
            for width in times:
                start = time.perf_counter()
                out[width] = engine.run_target([0], token, width, all_logits=True)
                times[width].append((time.perf_counter() - start) * 1000)
            alone, padded = out[1], out[MIN_PRODUCT_ROWS]
            same = (
                same
                and torch.equal(alone["logits"][:, :1], padded["logits"][:, :1])
                and torch.equal(alone["new_key"][..., :1, :], padded["new_key"][..., :1, :])
            )
        record = {
            "context": context,
            "alone_ms": round(statistics.median(times[1]), 2),
            "padded_ms": round(statistics.median(times[MIN_PRODUCT_ROWS]), 2),
            "same_bits": same,
        }
        result["steps"].append(record)
        print(
            f"{context:5d} positions: alone {record['alone_ms']:6.2f} ms, with a padding token "
            f"{record['padded_ms']:6.2f} ms, same bits: {same}"
        )
    print(f"the engine's lone step width on this machine: {engine.lone_step_width}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
