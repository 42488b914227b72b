"""A/B of two exported engines' target step in one process (e.g. an engine before and after a change
of its graph): the same rows prefilled in both, calls alternating between them, medians per point,
and whether their logits were equal. Run it with nothing else on the machine.

    python scripts/engine_ab.py DIR_A DIR_B [--names a,b] [--threads 2] [--calls 40] \
        [--contexts 256,1024] [--chains 1,2,4,8] [--rows 4,16] [--json FILE]

DIR_A / DIR_B: artifact directories (`loopspec convert onnx` or the cache under ~/.cache/loopspec/onnx).
The JSON holds one record per point: {"k", "rows", "context", "<a>_ms", "<b>_ms", "same_logits"}.
"""

import argparse

import torch
from tqdm import tqdm

from loopspec.engines.backends import artifact_engine
from loopspec.runtime.bench.step_runs import alternating_steps, integers, reserve_json, run_record, write_json


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("dirs", nargs=2)
    p.add_argument("--names", default="a,b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--contexts", type=integers, default=[256, 1024])
    p.add_argument("--chains", type=integers, default=[1, 2, 4, 8])
    p.add_argument("--rows", type=integers, default=[4, 16])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = args.names.split(",")
    if len(names) != 2 or names[0] == names[1]:
        p.error("--names takes two different names, a,b")
    reserve_json(args.json)
    most = max(args.rows + [1])
    engines = {
        name: artifact_engine("onnxruntime", d, max(args.contexts) + 32, args.threads).with_rows(most)
        for name, d in zip(names, args.dirs)
    }
    vocab = engines[names[0]].target_cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    result = run_record(
        " vs ".join(f"{n} ({d})" for n, d in zip(names, args.dirs)),
        args.threads,
        args.calls,
        lone_step_width={n: e.lone_step_width for n, e in engines.items()},
    )
    points = [(k, 1) for k in args.chains] + [(1, r) for r in args.rows]
    progress = tqdm(total=len(args.contexts) * len(points), desc="engine A/B", unit="point")
    for context in args.contexts:
        lengths = torch.linspace(int(context * 0.9), context, most).long().tolist()[::-1]
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        for engine in engines.values():
            for row, prompt in enumerate(prompts):
                engine.prefill(row, prompt, want_taps=False)
        for k, rows in points:
            medians, same = alternating_steps(engines, [list(range(1, k + 1))] * rows, lengths, args.calls)
            result["steps"].append(
                {
                    "k": k,
                    "rows": rows,
                    "context": lengths[0],
                    "same_logits": same,
                    **{f"{name}_ms": ms for name, ms in medians.items()},
                }
            )
            progress.update()
    progress.close()
    a, b = names
    for s in result["steps"]:
        print(
            f"k {s['k']:2d} x {s['rows']:2d} rows at {s['context']:5d} positions: {a} {s[a + '_ms']:7.2f} ms, "
            f"{b} {s[b + '_ms']:7.2f} ms ({s[a + '_ms'] / s[b + '_ms']:.2f}x)"
            f"{'' if s['same_logits'] else ', logits differ'}"
        )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
