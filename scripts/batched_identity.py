"""Every prompt of some prompt sets decoded with a method's setting in a batch of rows (continuous
batching, rows admitted and retired as they finish) against the same engine's `ar` on each prompt
alone: the count of identical outputs. A check a user can rerun on their own machine and engine.

    python scripts/batched_identity.py --prompts humaneval mt-bench mbpp my/own.jsonl --limit 20 \
        --method dloop --rows 8 [--precision gguf-int8act]
"""

import argparse
import sys

from loopspec.runtime.bench import load_prompt_sets
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.runtime.pipeline import load_pipeline


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", nargs="+", required=True)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--method", default="dloop")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--precision", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    pipe = load_pipeline("default", "default", backend="onnxruntime", precision=args.precision,
                         num_threads=args.threads)
    settings = pipe.settings(args.method)
    stops = pipe.stop_token_ids
    total = same = 0
    for name, prompts in load_prompt_sets(args.prompts, args.limit).items():
        ids = [pipe.encode(t) for t in prompts]
        alone = [generate(pipe.engine, p, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).tokens for p in ids]
        done = decode_all(Decoder(pipe.engine.with_rows(args.rows), settings),
                          [dict(key=i, prompt_ids=p, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
                           for i, p in enumerate(ids)])
        equal = sum(done[i].tokens == alone[i] for i in range(len(ids)))
        print(f"{name}: {equal}/{len(ids)} identical ({settings.describe()}, {args.rows} rows, {pipe.engine_name})",
              flush=True)
        total, same = total + len(ids), same + equal
    print(f"all: {same}/{total} identical")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
