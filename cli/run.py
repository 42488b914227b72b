"""Running the pair: `loopspec generate` (one prompt, streamed), `loopspec serve` (the OpenAI-compatible
server) and `loopspec prompts` (the target writes user prompts)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loopspec.cli.flags import (
    add_backend_flags,
    add_decoding_flags,
    add_grammar_flags,
    add_max_new_tokens_flag,
    add_pair_flags,
    add_sampling_flags,
    add_target_flag,
    add_threads_flag,
    check_step_costs,
    decoding_knobs,
    engine_choice,
    finite_float,
    grammar_spec,
    int_at_least,
    names_a_drafter,
    positive_int,
    refuse_shared_suffix,
    sampling,
)
from loopspec.errors import LoopspecError
from loopspec.files import output_dir, output_file

METHOD_HELP = "ar | dflash | dloop | suffix"


def add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt (streamed) and print stats")
    g.add_argument("--prompt", required=True)
    add_pair_flags(g)
    add_backend_flags(g)
    g.add_argument("--method", default="dflash", help=METHOD_HELP)
    add_decoding_flags(g)
    add_sampling_flags(g)
    add_max_new_tokens_flag(g, 128)
    add_grammar_flags(g)
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the target's chat template",
    )


def cmd_generate(args) -> int:
    from loopspec.runtime.pipeline import open_pipeline
    from loopspec.settings import check_method

    params = sampling(args)
    grammar = grammar_spec(args)  # a bad schema, regex or choice is refused before the model loads
    check_method(args.method, names_a_drafter(args))
    refuse_shared_suffix(args, "generate decodes one request")
    if not args.prompt.strip():  # known before the model loads (Pipeline.encode refuses it too)
        raise LoopspecError("empty prompt")
    pipe = open_pipeline(engine_choice(args))
    settings = pipe.settings(args.method, **decoding_knobs(args))
    check_step_costs(args, settings)
    if grammar is not None and settings.draft_sampling == "drafter" and not params.greedy:
        raise LoopspecError(f"{grammar.param} verifies drafts by the walk: use --draft-sampling walk")
    prompt_ids = pipe.encode(args.prompt, chat=args.chat)
    stream = TextStream(pipe)
    result = pipe.run(
        prompt_ids,
        settings,
        max_new_tokens=args.max_new_tokens,
        params=params,
        seed=args.seed,
        on_tokens=stream,
        grammar=grammar,
    )
    stream.flush()
    print()
    about = f"{settings.describe()}, {pipe.describe_engine()}"
    if settings.uses_drafter:
        about += f", drafter: {pipe.drafter_description}"
    if settings.adaptive and settings.drafting:
        about += f", adaptive: {pipe.describe_pacing(settings)}"
    if grammar is not None:
        about += f", output: {grammar.describe()}"
    if settings.method == "dloop":
        about += f", stages/verification {result.stats.stages_histogram}"
    if settings.tree_budget or settings.uses_suffix:
        nodes = result.stats.nodes_per_round
        about += (
            f", nodes/verification {sum(nodes) / max(len(nodes), 1):.1f}"
            f", suffix-only tokens {result.stats.suffix_tokens}"
        )
    print(f"[{about}] {result.stats.summary()}", file=sys.stderr)
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
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)

    def flush(self) -> None:
        text = self.pipe.decode(self.tokens)
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()


def add_serve(sub) -> None:
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_pair_flags(v, max_context=2048)  # not the target's maximum: the KV caches hold --max-batch-size rows
    v.add_argument("--method", default="dflash", help=METHOD_HELP)
    add_backend_flags(v)  # every backend batches its rows (onnxruntime and tensorrt up to their exported batch)
    add_decoding_flags(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int_at_least("--port", 1, 65535), default=8000)
    v.add_argument("--model-name", default=None, help="the model id clients send (default: the target's folder name)")
    v.add_argument("--max-batch-size", type=positive_int("--max-batch-size"), default=8)
    v.add_argument("--max-queue", type=positive_int("--max-queue"), default=64, help="waiting requests; more get 429")
    v.add_argument(
        "--prefill-chunk",
        type=positive_int("--prefill-chunk"),
        default=64,
        help="a longer prompt is prefilled this many tokens a step, between the running requests' steps",
    )
    v.add_argument(
        "--request-timeout",
        type=finite_float("--request-timeout"),
        default=600.0,
        help="seconds from arrival, queueing included",
    )
    v.add_argument("--max-body-bytes", type=positive_int("--max-body-bytes"), default=1 << 20)
    v.add_argument(
        "--max-tokens-limit",
        type=positive_int("--max-tokens-limit"),
        default=4096,
        help="the most max_tokens one request may ask for",
    )
    v.add_argument(
        "--read-timeout",
        type=finite_float("--read-timeout"),
        default=30.0,
        help="seconds a request (header and body) has to arrive whole; then 408 and the connection closes",
    )
    v.add_argument(
        "--max-connections",
        type=positive_int("--max-connections"),
        default=None,
        help="open connections (default: as many as the open-file limit allows, up to 4096)",
    )
    v.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        type=api_key,
        default=None,
        metavar="KEY",
        help="a bearer key /v1/ requests must carry ('Authorization: Bearer KEY'), else 401; repeat it "
        "for several; each key is a tenant: the shared suffix library never proposes one key's "
        "text to another (default: no keys, open to all)",
    )
    v.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level",
    )


def cmd_serve(args) -> int:
    from loopspec.runtime.connections import connection_limit, raise_open_file_limit
    from loopspec.runtime.pipeline import open_pipeline
    from loopspec.runtime.server import ServeConfig, serve
    from loopspec.settings import check_method
    from loopspec.suffix_library import check_library_size

    check_method(args.method, names_a_drafter(args))
    check_library_size(args.shared_suffix or 0, args.max_tokens_limit)  # (ServeConfig checks it too)
    connection_limit(args.max_connections, raise_open_file_limit())  # refused before the model loads
    check_port_free(args.host, args.port)  # before the model loads, and in one line rather than uvicorn's
    choice = engine_choice(args)
    pipe = open_pipeline(choice)
    settings = pipe.settings(args.method, **decoding_knobs(args))
    check_step_costs(args, settings)
    config = ServeConfig(
        settings=settings,
        model_name=args.model_name or choice.display_name,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
        prefill_chunk=args.prefill_chunk,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
        api_keys=tuple(args.api_keys or ()),
    )
    serve(pipe, host=args.host, port=args.port, config=config, log_level=args.log_level)
    return 0


def api_key(text: str) -> str:
    """An --api-key value (argparse type): one that cannot travel in a header is refused in one line."""
    from loopspec.tenancy import api_key_problem

    problem = api_key_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def check_port_free(host: str, port: int) -> None:
    """Refuse, in one line, an address the server could not listen on (a port in use, a host that is
    not this machine's): bound once here and released, as the server binds it (SO_REUSEADDR)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise LoopspecError(f"--host {host}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise LoopspecError(f"--port {port}: cannot listen on {host}:{port}: {e.strerror}") from None


def add_prompts(sub) -> None:
    w = sub.add_parser(
        "prompts",
        help="the target writes user prompts (a prompt file for `loopspec data`)",
        description="Sample user prompts from the target itself: its chat template up to the user's "
        'text, continued until the model ends the turn. Appends {"turns": [text]} lines '
        "to --out until it holds --count distinct prompts (re-running resumes).",
    )
    add_target_flag(w)
    w.add_argument("--out", required=True, help="JSONL prompt file (appended to)")
    w.add_argument("--count", type=positive_int("--count"), required=True, help="prompts the file should hold")
    w.add_argument(
        "--max-prompt-tokens",
        type=positive_int("--max-prompt-tokens"),
        default=256,
        help="a prompt the model has not ended within this many tokens is dropped",
    )
    w.add_argument("--batch-size", type=positive_int("--batch-size"), default=16)
    w.add_argument(
        "--starts-with",
        default="",
        metavar="TEXT",
        help="every prompt begins with TEXT (steers the topic, e.g. 'Write a Python function')",
    )
    add_sampling_flags(w, temperature=1.0)
    add_threads_flag(w)


def cmd_prompts(args) -> int:
    import torch

    from loopspec.pair import load_pair
    from loopspec.runtime import decoder
    from loopspec.train.data import write_prompts

    params = sampling(args)
    # the prompt file's folder is made where missing (and removed again if the run fails leaving it empty)
    with output_dir(Path(args.out).parent, "--out"), output_file(args.out, "--out"):
        if args.threads:
            torch.set_num_threads(args.threads)
        pair = load_pair(args.target, "none")
        report = write_prompts(
            target=pair.target,
            tokenizer=pair.tokenizer,
            out_path=args.out,
            count=args.count,
            stop_ids=set(pair.stop_token_ids),
            params=params,
            seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens,
            batch_size=args.batch_size,
            starts_with=args.starts_with,
            respond=decoder.regenerate_responses,
        )
    print(
        f"{report['prompts']} prompts in {args.out} ({report['written_this_run']} written this run from "
        f"{report['tries_this_run']} tries)"
    )
    return 0
