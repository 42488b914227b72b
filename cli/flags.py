"""The flags several commands share, each defined once, and the values they parse into.

One group per choice a user makes: the engine (the pair's flags and the backend's: an EngineChoice),
the decoding knobs (made from loopspec.settings.KNOBS, where each is declared), sampling
(SamplingParams and the seed), and the outputs a command writes. Only the standard library and
torch-free parts of the core are imported at module level: `loopspec --help` loads no model code."""

from __future__ import annotations

import argparse
import json
import math
import sys

from loopspec.errors import LoopspecError
from loopspec.settings import KNOBS

TARGET_HELP = "'default' (SmolLM2-135M-Instruct), an HF checkpoint dir or a .gguf file"
MASK_TOKEN_HELP = "mask token for a drafter whose config has none"


# --------------------------------------------------------------------------------------------------
# Parsing one value (argparse types: a bad value is one line naming the flag)


def int_at_least(name, least, most=None):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < least or (most is not None and value > most):
            bound = f">= {least}" if most is None else f"in [{least}, {most}]"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {value}")
        return value

    return parse


def positive_int(name):
    return int_at_least(name, 1)


def seed(name):  # seeds torch.Generator.manual_seed, which takes an unsigned 64-bit value
    return int_at_least(name, 0, (1 << 64) - 1)


def finite_float(name, positive=True):
    """A finite number > 0 (or >= 0 with positive=False): inf would pass a `> 0` check and nan fails
    every comparison, so either would surface only deep inside a long run."""

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                f"{name} must be a finite number {'>' if positive else '>='} 0, got {text}"
            )
        return value

    return parse


def int_list(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoopspecError(f"{name} must be comma-separated integers, got {text!r}") from None


class DeprecatedSpelling(argparse.Action):
    """An old spelling of a flag: it still works, into the new flag's destination, and says once on
    stderr which flag to use instead."""

    def __init__(self, option_strings, dest, instead: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"loopspec: warning: {option_string} is deprecated; use {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, values)


# --------------------------------------------------------------------------------------------------
# Single flags many commands take


def add_target_flag(p: argparse.ArgumentParser, help: str = TARGET_HELP) -> None:
    p.add_argument("--target", default="default", help=help)


def add_mask_token_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mask-token-id", type=int_at_least("--mask-token-id", 0), default=None, help=MASK_TOKEN_HELP)


def add_threads_flag(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--threads", type=positive_int("--threads"), default=None, help=help)


def add_max_new_tokens_flag(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=default)


# --------------------------------------------------------------------------------------------------
# The engine choice: the pair's flags, then the backend's (kept apart: some commands list their own
# flags between them)


def add_pair_flags(p: argparse.ArgumentParser, max_context: int | None = None) -> None:
    add_target_flag(p)
    p.add_argument(
        "--drafter",
        default="default",
        help="'default', a z-lab DFlash or DeepSpec DSpark/DFlash drafter dir, or 'none'",
    )
    p.add_argument(
        "--max-context",
        type=positive_int("--max-context"),
        default=max_context,
        help="KV cache length (default: the target's max_position_embeddings)"
        if max_context is None
        else f"KV cache length per row (default {max_context}: the caches hold --max-batch-size rows of it)",
    )
    add_mask_token_flag(p)
    add_threads_flag(p, "torch CPU threads")
    p.add_argument("--device", default="cpu", help="where the torch engine runs: cpu or cuda")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay captured CUDA graphs of the verify and draft forwards (default: on with --device cuda)",
    )


def add_backend_flags(p: argparse.ArgumentParser, side_by_side: bool = False) -> None:
    p.add_argument(
        "--backend",
        default="auto",
        help="auto (default: onnxruntime on the CPU when the onnx extra is installed, else torch) | "
        "torch | onnxruntime (engines exported once and cached, or the ones in --onnx-dir) | "
        "tensorrt (the plans in --trt-dir)"
        + ("; a comma list (torch,onnxruntime) runs every backend side by side" if side_by_side else ""),
    )
    p.add_argument(
        "--onnx-dir",
        default=None,
        help="run the engines of this `loopspec convert onnx` directory (--target/--drafter unused)",
    )
    p.add_argument(
        "--trt-dir",
        default=None,
        help="run the TensorRT plans of this `loopspec convert trt` directory (--target/--drafter unused)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        help="what the target computes with: auto (default: on onnxruntime a GGUF target runs its own "
        "blocks with int8 activations in the fused step graph, gguf-fused, the fastest CPU engine, chains "
        "only; else fp32) | fp32 (the reference) | gguf-fused | gguf-int8act (draft trees too) | "
        "gguf-fp32act (onnxruntime, GGUF target)"
        + ("; a comma list (fp32,gguf-int8act) runs every engine side by side" if side_by_side else ""),
    )
    p.add_argument(
        "--step-costs",
        default=None,
        metavar="FILE",
        help="what a step costs on this engine (a table from `loopspec costs --out FILE`), for the "
        "verification budget of --adaptive (default: the table `loopspec costs` stored for this "
        "engine on this CPU, if any; else --adaptive times its rounds)",
    )


def names_a_drafter(args) -> bool:
    """Whether the flags name a drafter (loopspec.runtime.pipeline.EngineChoice.names_a_drafter),
    known from the flags alone: commands that need one refuse its absence before the target is read."""
    from loopspec.runtime.pipeline import names_a_drafter as names

    return names(args.drafter, args.onnx_dir, args.trt_dir)


def engine_choice(args, **overrides):
    """The one value of which engine runs (loopspec.runtime.pipeline.EngineChoice), from the flags."""
    from loopspec.runtime.pipeline import EngineChoice

    flags = dict(
        target=args.target,
        drafter=args.drafter,
        backend=args.backend,
        precision=args.precision,
        device=args.device,
        max_context=args.max_context,
        threads=args.threads,
        cuda_graphs=args.cuda_graphs,
        onnx_dir=args.onnx_dir,
        trt_dir=args.trt_dir,
        mask_token_id=args.mask_token_id,
        step_costs=args.step_costs,
    )
    return EngineChoice(**(flags | overrides))


def check_step_costs(args, settings) -> None:
    """Refuse --step-costs where no verification budget would read it (a method that drafts nothing,
    or --no-adaptive): a table given is used, never dropped."""
    if args.step_costs is not None and not (settings.adaptive and settings.drafting):
        why = "--no-adaptive" if settings.drafting else f"method {settings.method}"
        raise LoopspecError(f"--step-costs feeds the verification budget of --adaptive, which {why} does not run")


def side_by_side(args) -> list:
    """--backend and --precision as comma lists: every (backend, precision) engine, the first the reference."""
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    if not backends or len(set(backends)) != len(backends):
        raise LoopspecError(f"--backend needs distinct backends, got {args.backend!r}")
    if not precisions or len(set(precisions)) != len(precisions):
        raise LoopspecError(f"--precision needs distinct precisions, got {args.precision!r}")
    first = engine_choice(args, backend=backends[0], precision=precisions[0])  # the target, resolved once
    return [engine_choice(args, target=first.target, backend=b, precision=p) for b in backends for p in precisions]


# --------------------------------------------------------------------------------------------------
# Decoding: one flag per knob of loopspec.settings.DecodingSettings, as its Knob declares it


def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    """How a method drafts (resolved once by loopspec.settings.resolve_settings; see decoding_knobs)."""
    for name, knob in KNOBS.items():
        if knob.kind is bool:
            p.add_argument(
                knob.flag, dest=name, action=argparse.BooleanOptionalAction, default=knob.unset, help=knob.help
            )
        elif knob.kind is int:
            p.add_argument(
                knob.flag,
                dest=name,
                type=int_at_least(knob.flag, knob.least, knob.most),
                default=knob.unset,
                metavar=knob.metavar,
                help=knob.help,
            )
        else:
            p.add_argument(
                knob.flag,
                dest=name,
                type=float if knob.kind is float else None,
                choices=knob.choices,
                default=knob.unset,
                metavar=knob.metavar,
                help=knob.help,
            )


def refuse_shared_suffix(args, why: str) -> None:
    """--shared-suffix keeps finished requests' outputs for a server's later requests: a command that
    decodes each request alone has none to give them, so it refuses the flag rather than ignore it."""
    if args.shared_suffix:
        raise LoopspecError(
            f"--shared-suffix applies across a server's requests ({why}): use it with "
            "loopspec serve, or scripts/shared_suffix.py to measure it"
        )


def decoding_knobs(args) -> dict:
    """The knobs as loopspec.settings.resolve_settings takes them (unset ones as their Knob's `unset`)."""
    return {name: getattr(args, name) for name in KNOBS}


# --------------------------------------------------------------------------------------------------
# Sampling


def add_sampling_flags(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=seed("--seed"), default=0)


def sampling(args):
    from loopspec.decoding import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


# --------------------------------------------------------------------------------------------------
# Structured output


def add_grammar_flags(p: argparse.ArgumentParser) -> None:
    """At most one grammar every generated token obeys (drafts the grammar rejects are pruned before
    verification; the output equals constrained plain decoding's)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE|JSON",
        help="structured output: a JSON value matching this JSON schema (a file, or the schema itself)",
    )
    g.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
    g.add_argument("--regex", default=None, help="structured output: text matching this regular expression")
    g.add_argument(
        "--choice",
        action="append",
        default=None,
        metavar="TEXT",
        help="structured output: exactly one of these strings (repeat the flag for each)",
    )


def grammar_spec(args):
    """The grammar the flags name (loopspec.runtime.constraint.GrammarSpec, checked without a model),
    or None."""
    from loopspec.runtime.constraint import GrammarSpec

    if args.json_object:
        return GrammarSpec("json_object", None, "--json-object")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex, "--regex")
    if args.choice is not None:
        return GrammarSpec("choice", args.choice, "--choice")
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise LoopspecError(f"--json-schema: cannot read {args.json_schema}: {e.strerror}") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise LoopspecError(f"--json-schema: not JSON: {e}") from None
    return GrammarSpec("json_schema", schema, "--json-schema")


# --------------------------------------------------------------------------------------------------
# Outputs


def add_json_flag(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--json", dest="json_out", default=None, help=help)
