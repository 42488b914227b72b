"""Every prompt of some prompt sets decoded with a method's setting in a batch of rows (continuous
batching, rows admitted and retired as they finish) against the same engine's `ar` on each prompt
alone: the count of identical outputs. A check a user can rerun on their own machine and engine.

    python scripts/batched_identity.py --prompts humaneval mt-bench mbpp my/own.jsonl --limit 20 \
        --method dloop dloop+tree4+suffix suffix --rows 8 [--precision gguf-int8act]
"""

import argparse
import sys

from loopspec.errors import LoopspecError
from loopspec.runtime.bench import load_prompt_sets
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.runtime.pipeline import load_pipeline
from loopspec.method_names import method_variant


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", nargs="+", required=True)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--method",
        nargs="+",
        default=["dloop"],
        help="methods as bench names them: dloop, dloop+tree4+suffix, dloop+first2, ...",
    )
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--precision", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    pipe = load_pipeline(
        "default", "default", backend="onnxruntime", precision=args.precision, num_threads=args.threads
    )
    try:
        settings = [pipe.settings(method, **overrides) for method, overrides in map(method_variant, args.method)]
    except LoopspecError as e:
        p.error(str(e))
    stops = pipe.stop_token_ids
    total = same = 0
    for name, prompts in load_prompt_sets(args.prompts, args.limit).items():
        ids = [pipe.encode(t) for t in prompts]
        alone = [generate(pipe.engine, p, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).tokens for p in ids]
        for setting in settings:
            done = decode_all(
                Decoder(pipe.engine.with_rows(args.rows), setting),
                [
                    dict(key=i, prompt_ids=p, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
                    for i, p in enumerate(ids)
                ],
            )
            equal = sum(done[i].tokens == alone[i] for i in range(len(ids)))
            print(
                f"{name}: {equal}/{len(ids)} identical ({setting.describe()}, {args.rows} rows, {pipe.engine_name})",
                flush=True,
            )
            total, same = total + len(ids), same + equal
    print(f"all: {same}/{total} identical")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
