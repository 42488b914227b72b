"""The `loopspec` command line. Bad input → one clear line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys

from loopspec.errors import LoopspecError


def _positive_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value
    return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct), an HF checkpoint dir or a .gguf file")
    p.add_argument("--drafter", default="default", help="'default', a z-lab DFlash drafter dir, or 'none'")
    p.add_argument("--max-context", type=_positive_int("--max-context"), default=None,
                   help="KV cache length (default: the target's max_position_embeddings)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token for a drafter whose config has none")
    p.add_argument("--threads", type=_positive_int("--threads"), default=None, help="torch CPU threads")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=_positive_int("--block-size"), default=None,
                   help="draft block size k (default: the drafter's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loopspec", description="Lossless speculative decoding (DFlash, DLoop).")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt (streamed) and print stats")
    g.add_argument("--prompt", required=True)
    _add_model_args(g)
    g.add_argument("--method", default="dflash", help="ar | dflash")
    _add_sampling_args(g)
    g.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the target's chat template")

    b = sub.add_parser("bench", help="every method on the same prompts in one process")
    b.add_argument("--prompts", required=True, nargs="+", help="JSONL files of {\"turns\": [...]}")
    _add_model_args(b)
    b.add_argument("--methods", default="ar,dflash", help="comma-separated: ar,dflash")
    _add_sampling_args(b)
    b.add_argument("--limit", type=_positive_int("--limit"), default=None)
    b.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    b.add_argument("--all-turns", action="store_true", help="use every turn (each as its own prompt)")
    b.add_argument("--repeats", type=_positive_int("--repeats"), default=1, help="timed repeats (median)")
    b.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    b.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    return parser


def cmd_generate(args) -> int:
    from loopspec.decoding import SamplingParams
    from loopspec.runtime.pipeline import load_pipeline

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    pipe = load_pipeline(args.target, args.drafter, max_context=args.max_context,
                         mask_token_id=args.mask_token_id, num_threads=args.threads)
    block_size = pipe.block_size_for(args.method, args.block_size)
    prompt_ids = pipe.encode(args.prompt, chat=args.chat)
    stream = TextStream(pipe)
    result = pipe.run(prompt_ids, method=args.method, max_new_tokens=args.max_new_tokens, params=params,
                      block_size=block_size, seed=args.seed, on_tokens=stream)
    stream.flush()
    print()
    drafter = f", drafter: {pipe.drafter_description}" if args.method != "ar" else ""
    print(f"[{args.method}, k={block_size}{drafter}] {result.stats.summary()}", file=sys.stderr)
    return 0


class TextStream:
    """Prints decoded text as tokens arrive (re-decoding the whole tail keeps multi-byte chars intact)."""

    def __init__(self, pipe):
        self.pipe, self.tokens, self.printed = pipe, [], 0

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens += new_tokens
        text = self.pipe.decode(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
            return
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)

    def flush(self) -> None:
        text = self.pipe.decode(self.tokens)
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()


def cmd_bench(args) -> int:
    from loopspec.decoding import SamplingParams
    from loopspec.runtime.bench import run_bench

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    run_bench(prompt_files=args.prompts, methods=[m.strip() for m in args.methods.split(",") if m.strip()],
              target=args.target, drafter=args.drafter, limit=args.limit, max_new_tokens=args.max_new_tokens,
              all_turns=args.all_turns, params=params, block_size=args.block_size, seed=args.seed,
              repeats=args.repeats, json_out=args.json_out, chat=args.chat, max_context=args.max_context,
              mask_token_id=args.mask_token_id, num_threads=args.threads)
    return 0


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 with one line for malformed flags
    try:
        return COMMANDS[args.command](args)
    except LoopspecError as e:
        print(f"loopspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loopspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
