"""The `loopspec` command line (the package loopspec.cli). Bad input → one clear line on stderr and
exit code 2.

The top floor: it may import every layer (core, train, engines, convert, runtime) and nothing imports
it. It parses flags into the values the layers take (EngineChoice, DecodingSettings' knobs,
SamplingParams, a bench's BenchPlan) and prints; it builds nothing itself. By what users do:
flags.py (the flags commands share, each defined once), run.py (generate, serve, prompts),
measure.py (bench, tune, costs), train.py (data, train), convert.py (convert onnx / quantize / trt /
bundle). The layers are imported inside each command so that `loopspec --help` and a refused flag
answer without loading torch."""

from __future__ import annotations

import argparse
import sys

from loopspec.cli import convert, measure, run, train
from loopspec.errors import LoopspecError

# (add its parser, run it), in the order `loopspec --help` lists the commands
COMMANDS = {
    "generate": (run.add_generate, run.cmd_generate),
    "bench": (measure.add_bench, measure.cmd_bench),
    "tune": (measure.add_tune, measure.cmd_tune),
    "costs": (measure.add_costs, measure.cmd_costs),
    "serve": (run.add_serve, run.cmd_serve),
    "convert": (convert.add_convert, convert.cmd_convert),
    "data": (train.add_data, train.cmd_data),
    "prompts": (run.add_prompts, run.cmd_prompts),
    "train": (train.add_train, train.cmd_train),
}


class _Parser(argparse.ArgumentParser):
    """Every parser of the command line (subcommands are made of this class too): a malformed flag
    gets the one line every other bad input gets, `loopspec: error: ...`, naming the subcommand.
    Flags are taken only by their full names: an abbreviation (`--prom` for `--prompt`) would change
    meaning the day a second flag shares its prefix."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, not argparse's usage dump
        command = self.prog.removeprefix("loopspec").strip()
        text = " ".join(f"{command + ': ' if command else ''}{message}".split())
        self.exit(2, f"loopspec: error: {text}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loopspec", description="Lossless speculative decoding (DFlash, DLoop).")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in COMMANDS.values():
        add_parser(sub)
    return parser


def check_utf8(argv: list[str]) -> None:
    """Refuse an argument that is not valid UTF-8 (Python keeps its bytes as lone surrogates, which
    would fail only where the text is first encoded: a tokenizer, a JSON report), naming its flag."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            byte = ord(arg[e.start]) - 0xDC00 if 0xDC80 <= ord(arg[e.start]) <= 0xDCFF else None
            flag = argv[i - 1] if i and argv[i - 1].startswith("--") and not arg.startswith("--") else None
            where = f"the value of {flag}" if flag else f"argument {arg!r}"
            what = f" (byte 0x{byte:02x})" if byte is not None else ""
            raise LoopspecError(f"{where} is not valid UTF-8{what}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_utf8(argv)
    except LoopspecError as e:
        print(f"loopspec: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)  # argparse itself exits 2 with one line for malformed flags
    args.argv = argv  # reports record the exact command
    try:
        return COMMANDS[args.command][1](args)
    except LoopspecError as e:
        print(f"loopspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loopspec: interrupted", file=sys.stderr)
        return 130
