"""The `loopspec` command line (the package loopspec.cli). Bad input → one clear line on stderr and
exit code 2.

The top floor: it may import every layer (core, train, engines, convert, runtime) and nothing imports
it. It parses flags into the values the layers take (EngineChoice, DecodingSettings' knobs,
SamplingParams) and prints; it builds nothing itself. The layers are imported inside each command
so that `loopspec --help` and a refused flag answer without loading torch."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.precisions import precision_names

# what `convert onnx` exports a pair in (loopspec/precisions.py), and what `convert quantize` makes
PAIR_PRECISIONS = precision_names(backend="onnxruntime", weights=("fp32", "gguf"))
QUANTIZED_PRECISIONS = precision_names(weights=("modelopt",))


def _int_at_least(name, least, most=None):
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


def _positive_int(name):
    return _int_at_least(name, 1)


def _non_negative_int(name):
    return _int_at_least(name, 0)


def _seed(name):  # seeds torch.Generator.manual_seed, which takes an unsigned 64-bit value
    return _int_at_least(name, 0, (1 << 64) - 1)


def _finite_float(name, positive=True):
    """A finite number > 0 (or >= 0 with positive=False): inf would pass a `> 0` check and nan fails
    every comparison, so either would surface only deep inside a long run."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number {'>' if positive else '>='} 0, "
                                             f"got {text}")
        return value
    return parse


def _add_model_args(p: argparse.ArgumentParser, max_context: int | None = None) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct), an HF checkpoint dir or a .gguf file")
    p.add_argument("--drafter", default="default", help="'default', a z-lab DFlash or DeepSpec DSpark/DFlash drafter dir, or 'none'")
    p.add_argument("--max-context", type=_positive_int("--max-context"), default=max_context,
                   help="KV cache length (default: the target's max_position_embeddings)" if max_context is None else
                   f"KV cache length per row (default {max_context}: the caches hold --max-batch-size rows of it)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token for a drafter whose config has none")
    p.add_argument("--threads", type=_positive_int("--threads"), default=None, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="where the torch engine runs: cpu or cuda")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay captured CUDA graphs of the verify and draft forwards (default: on with --device cuda)")


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    """How a method drafts (resolved once by loopspec.settings.resolve_settings; see _decoding_knobs)."""
    p.add_argument("--block-size", type=_positive_int("--block-size"), default=None,
                   help="draft block size k (default: the drafter's; suffix: 8)")
    p.add_argument("--gate-threshold", type=float, default=None,
                   help="dloop: add a stage while the last one's summed draft log-prob is >= this (default -0.5)")
    p.add_argument("--gate", default=None, metavar="SCORE",
                   help="dloop: what the gate scores a stage by: logprob (its drafts' summed log-probs; default) "
                        "or confidence (a DSpark drafter's confidence head: the summed log of its estimates)")
    p.add_argument("--max-stages", type=_positive_int("--max-stages"), default=None,
                   help="dloop: draft stages per verification (default 4)")
    p.add_argument("--tree-budget", type=_non_negative_int("--tree-budget"), default=None,
                   help="dflash/dloop: draft-tree nodes per verification, best first over the drafter's "
                        "candidates (0 = the argmax chain; default: the tuned setting, else 0)")
    p.add_argument("--suffix", action=argparse.BooleanOptionalAction, default=None,
                   help="dflash/dloop: also verify the continuation of the text's longest repeated suffix "
                        "as a tree branch (default: the tuned setting, else off)")
    p.add_argument("--suffix-first", type=_non_negative_int("--suffix-first"), default=None, metavar="N",
                   help="dflash/dloop chain policy: after the text repeats an earlier N-gram (N = 2..6), verify "
                        "what followed it instead of drafting (0 = off; default: the tuned setting, else off)")
    p.add_argument("--suffix-then-draft", action=argparse.BooleanOptionalAction, default=None,
                   help="with --suffix-first: after the copy, the drafter's stage drafts on from its last token "
                        "(default: the tuned setting, else off)")
    p.add_argument("--draft-sampling", choices=("walk", "drafter"), default=None,
                   help="at temperature > 0: walk (default; the drafter's argmax drafts, and a seeded run commits "
                        "exactly the tokens ar does) | drafter (drafts sampled from the drafter's distribution q, "
                        "accepted with probability min(1, p/q): same output distribution, more accepted drafts "
                        "where q is close to p; chains only, torch backend)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="decode plainly while drafting does not pay (output unchanged)")


def _decoding_knobs(args) -> dict:
    return {"block_size": args.block_size, "gate_threshold": args.gate_threshold, "gate": args.gate,
            "max_stages": args.max_stages,
            "tree_budget": args.tree_budget, "suffix": args.suffix, "suffix_first": args.suffix_first,
            "suffix_then_draft": args.suffix_then_draft, "draft_sampling": args.draft_sampling,
            "adaptive": args.adaptive}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    _add_decoding_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=_seed("--seed"), default=0)


def _add_backend_args(p: argparse.ArgumentParser, side_by_side: bool = False) -> None:
    p.add_argument("--backend", default="auto",
                   help="auto (default: onnxruntime on the CPU when the onnx extra is installed, else torch) | "
                        "torch | onnxruntime (engines exported once and cached, or the ones in --onnx-dir) | "
                        "tensorrt (the plans in --trt-dir)"
                   + ("; a comma list (torch,onnxruntime) runs every backend side by side" if side_by_side else ""))
    p.add_argument("--onnx-dir", default=None,
                   help="run the engines of this `loopspec convert onnx` directory (--target/--drafter unused)")
    p.add_argument("--trt-dir", default=None,
                   help="run the TensorRT plans of this `loopspec convert trt` directory (--target/--drafter unused)")
    p.add_argument("--precision", default="auto",
                   help="what the target computes with: auto (default: on onnxruntime a GGUF target runs its own "
                        "Q4_1/Q8_0 blocks with int8 activations, the fastest CPU engine; else fp32) | fp32 (the "
                        "reference) | gguf-int8act | gguf-fp32act (onnxruntime, GGUF target)"
                   + ("; a comma list (fp32,gguf-int8act) runs every engine side by side" if side_by_side else ""))


class _Parser(argparse.ArgumentParser):
    """Every parser of the command line (subcommands are made of this class too): a malformed flag
    gets the one line every other bad input gets, `loopspec: error: ...`, naming the subcommand."""

    def error(self, message):  # one line, not argparse's usage dump
        command = self.prog.removeprefix("loopspec").strip()
        text = " ".join(f"{command + ': ' if command else ''}{message}".split())
        self.exit(2, f"loopspec: error: {text}\n")


def _check_output_file(path: str | None, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written after it: a directory,
    or a file in a folder that does not exist or is not writable."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise LoopspecError(f"{flag} {path} is a directory; name a file to write")
    folder = path.parent
    if not folder.is_dir():
        raise LoopspecError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise LoopspecError(f"{flag} {path}: not writable")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loopspec", description="Lossless speculative decoding (DFlash, DLoop).")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt (streamed) and print stats")
    g.add_argument("--prompt", required=True)
    _add_model_args(g)
    _add_backend_args(g)
    g.add_argument("--method", default="dflash", help="ar | dflash | dloop | suffix")
    _add_sampling_args(g)
    g.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the target's chat template")

    b = sub.add_parser("bench", help="every method on the same prompts in one process")
    b.add_argument("--prompts", required=True, nargs="+",
                   help="JSONL files of {\"turns\": [...]} (dataset = file stem) or built-in sets "
                        "(humaneval, mt-bench from installed packages; mbpp, math500, alpaca downloaded on first "
                        "use and cached; python -m loopspec.prompt_sets lists them)")
    _add_model_args(b)
    _add_backend_args(b, side_by_side=True)
    b.add_argument("--methods", default="ar,dflash",
                   help="comma-separated: ar, dflash, dloop, suffix, hf, hf-lookup (transformers), llamacpp, "
                        "llamacpp-dflash (llama-server on the target's GGUF, plain / with the drafter); dflash/dloop "
                        "may take +chain, +treeN, +suffix, +firstN, +thendraft (dloop+tree16+suffix), dloop also "
                        "+gateconf (its stages gated by a DSpark confidence head), over the flags' setting")
    b.add_argument("--llama-server", default=None,
                   help="the llama-server binary the llamacpp peers run (default: llama-server on PATH; "
                        "scripts/build_llama_server.sh builds one)")
    _add_sampling_args(b)
    b.add_argument("--limit", type=_positive_int("--limit"), default=None)
    b.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    b.add_argument("--all-turns", action="store_true", help="use every turn (each as its own prompt)")
    b.add_argument("--repeats", type=_positive_int("--repeats"), default=1, help="timed repeats (median)")
    b.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    b.add_argument("--out", dest="out_dir", default=None,
                   help="report directory: bench.json, bench.md (tables per dataset) and PNG plots")
    b.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--cost-model", action="store_true",
                   help="also measure bandwidth, t_verify(n), draft time and each method's speedup bound")

    u = sub.add_parser("tune", help="sweep DLoop gate x stages (x block size), then tree budget x suffix; "
                                    "store the fastest lossless setting")
    u.add_argument("--prompts", required=True, nargs="+", help="calibration JSONL files or built-in sets (python -m loopspec.prompt_sets)")
    _add_model_args(u)
    u.add_argument("--limit", type=_positive_int("--limit"), default=8)
    u.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=96)
    # the DLoop paper's grid plus lower gates: a small drafter's block log-prob sums sit far below -1
    u.add_argument("--thresholds", default="-0.25,-0.5,-0.75,-1.0,-2.0,-4.0",
                   help="comma-separated gate thresholds (write --thresholds=-1,-2)")
    u.add_argument("--stages", default="1,2,3,4")
    u.add_argument("--block-sizes", default=None, help="comma-separated (default: the drafter's)")
    u.add_argument("--tree-budgets", default="0,8,16,32",
                   help="draft-tree budgets tried on the fastest chain setting (0 = the chain)")
    u.add_argument("--suffix", choices=("sweep", "on", "off"), default="sweep",
                   help="the suffix branch: tried off and on (sweep), or fixed")
    u.add_argument("--suffix-firsts", default="0,2,3,4",
                   help="chain-policy match lengths tried on the best chain and the best tree (0 = off; 2..6)")
    u.add_argument("--no-store", action="store_true", help="print the result, do not write it to the drafter")
    u.add_argument("--json", dest="json_out", default=None)
    _add_backend_args(u)  # tune where the setting will run: backends differ in what a stage costs

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    _add_model_args(v, max_context=2048)  # not the target's maximum: the KV caches hold --max-batch-size rows
    v.add_argument("--method", default="dflash", help="ar | dflash | dloop | suffix")
    _add_backend_args(v)  # every backend batches its rows (onnxruntime and tensorrt up to their exported batch)
    _add_decoding_args(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=_int_at_least("--port", 1, 65535), default=8000)
    v.add_argument("--model-name", default=None, help="the model id clients send (default: the target's folder name)")
    v.add_argument("--max-batch-size", type=_positive_int("--max-batch-size"), default=8)
    v.add_argument("--max-queue", type=_positive_int("--max-queue"), default=64, help="waiting requests; more get 429")
    v.add_argument("--prefill-chunk", type=_positive_int("--prefill-chunk"), default=64,
                   help="a longer prompt is prefilled this many tokens a step, between the running requests' steps")
    v.add_argument("--request-timeout", type=float, default=600.0, help="seconds from arrival, queueing included")
    v.add_argument("--max-body-bytes", type=_positive_int("--max-body-bytes"), default=1 << 20)
    v.add_argument("--max-tokens-limit", type=_positive_int("--max-tokens-limit"), default=4096,
                   help="the most max_tokens one request may ask for")
    v.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level")

    c = sub.add_parser("convert", help=f"artifacts out, by stage: {', '.join(CONVERT_STAGES)}")
    stages = c.add_subparsers(dest="stage", required=True)
    for stage, (help_text, add_args, _) in CONVERT_STAGES.items():
        add_args(stages.add_parser(stage, help=help_text))

    d = sub.add_parser("data", help="training data: responses regenerated by the target",
                       description="Regenerate the target's responses to --prompts into --out (re-running resumes). "
                                   "--kept DIR copies the samples kept in DIR instead of regenerating them; "
                                   "--pack DIR writes the kept form (token ids, xz) of --out into DIR and exits.")
    d.add_argument("--prompts", nargs="+", help="JSONL files of {\"turns\": [...]} (required unless --pack)")
    d.add_argument("--target", default="default")
    d.add_argument("--out", required=True, help="data directory (re-running resumes)")
    d.add_argument("--kept", default=None, metavar="DIR",
                   help="kept data (e.g. data/smollm2-135m-instruct): its samples are copied, not regenerated; "
                        "with --cache-taps their taps are recomputed by one teacher-forced target forward")
    d.add_argument("--pack", default=None, metavar="DIR",
                   help="only write --out's samples (token ids, no taps) into the kept directory DIR, adding "
                        "to what DIR holds, and exit")
    d.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=256)
    d.add_argument("--max-prompt-tokens", type=_positive_int("--max-prompt-tokens"), default=2048,
                   help="skip longer prompts (chat template included; default 2048 keeps every livecodebench prompt)")
    d.add_argument("--batch-size", type=_positive_int("--batch-size"), default=16)
    d.add_argument("--limit", type=_positive_int("--limit"), default=None, help="prompts per file")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--seed", type=_seed("--seed"), default=0)
    d.add_argument("--cache-taps", action="store_true", help="also store the target's taps (offline training)")
    d.add_argument("--tap-layers", default=None, help="comma-separated target layer ids (default: 5 by formula)")
    d.add_argument("--threads", type=_positive_int("--threads"), default=None)

    w = sub.add_parser("prompts", help="the target writes user prompts (a prompt file for `loopspec data`)",
                       description="Sample user prompts from the target itself: its chat template up to the user's "
                                   "text, continued until the model ends the turn. Appends {\"turns\": [text]} lines "
                                   "to --out until it holds --count distinct prompts (re-running resumes).")
    w.add_argument("--target", default="default")
    w.add_argument("--out", required=True, help="JSONL prompt file (appended to)")
    w.add_argument("--count", type=_positive_int("--count"), required=True, help="prompts the file should hold")
    w.add_argument("--max-prompt-tokens", type=_positive_int("--max-prompt-tokens"), default=256,
                   help="a prompt the model has not ended within this many tokens is dropped")
    w.add_argument("--batch-size", type=_positive_int("--batch-size"), default=16)
    w.add_argument("--starts-with", default="", metavar="TEXT",
                   help="every prompt begins with TEXT (steers the topic, e.g. 'Write a Python function')")
    w.add_argument("--temperature", type=float, default=1.0)
    w.add_argument("--top-p", type=float, default=1.0)
    w.add_argument("--top-k", type=int, default=0)
    w.add_argument("--seed", type=_seed("--seed"), default=0)
    w.add_argument("--threads", type=_positive_int("--threads"), default=None)

    t = sub.add_parser("train", help="train a DFlash drafter on a data directory")
    t.add_argument("--data", required=True, help="directory made by `loopspec data`")
    t.add_argument("--target", default="default")
    t.add_argument("--out", required=True, help="drafter directory (z-lab format); re-running resumes")
    t.add_argument("--init", default=None, help="start from this drafter directory")
    t.add_argument("--num-layers", type=_positive_int("--num-layers"), default=None,
                   help="drafter layers (default 1; with --init, more than the init's deepens it: the new "
                        "layers start as no-ops, so training starts from the init's drafts)")
    t.add_argument("--block-size", type=_positive_int("--block-size"), default=None,
                   help="block size (default 16, or the --init drafter's; the weights do not depend on it)")
    t.add_argument("--tap-layers", default=None, help="comma-separated target layer ids (default: formula)")
    t.add_argument("--num-taps", type=_positive_int("--num-taps"), default=None,
                   help="number of taps by the formula (default: one per drafter layer)")
    t.add_argument("--mask-token-id", type=int, default=None)
    t.add_argument("--anchors", type=_positive_int("--anchors"), default=512)
    t.add_argument("--epochs", type=_finite_float("--epochs"), default=1.0)
    t.add_argument("--max-steps", type=_positive_int("--max-steps"), default=None)
    t.add_argument("--max-minutes", type=_finite_float("--max-minutes"), default=None, help="stop (and save) after this wall time")
    t.add_argument("--stop-after-steps", type=_positive_int("--stop-after-steps"), default=None,
                   help="stop (and save) after this many steps of the unchanged schedule; re-running resumes")
    t.add_argument("--batch-sequences", type=_positive_int("--batch-sequences"), default=4)
    t.add_argument("--lr", type=_finite_float("--lr"), default=6e-4)
    t.add_argument("--gamma", type=_finite_float("--gamma"), default=None,
                   help="decay of the loss weight along the block (default: by block size)")
    t.add_argument("--dpace", action="store_true", help="D-PACE position weighting")
    t.add_argument("--kl-weight", type=_finite_float("--kl-weight", positive=False), default=0.0, help="forward KL to the target (online taps)")
    t.add_argument("--causal-in-block", action="store_true")
    t.add_argument("--loop-stages", type=int, nargs="?", const=3, default=0,
                   help="DLoop loop-aware training: per anchor S-1 ~ U{1..N} extra stages (e.g. 3; 0 = DFlash)")
    t.add_argument("--draft-vocab-size", type=_positive_int("--draft-vocab-size"), default=None,
                   help="reduced draft vocabulary (most frequent response tokens) + d2t map")
    t.add_argument("--markov-rank", type=_positive_int("--markov-rank"), default=None,
                   help="DSpark: add a low-rank Markov head of this rank (its bias starts at zero, so training "
                        "starts from the --init drafter's drafts)")
    t.add_argument("--markov-head", default="vanilla", metavar="TYPE",
                   help="DSpark: the Markov head's type, vanilla | gated | rnn (vanilla is the one vLLM and "
                        "llama.cpp run)")
    t.add_argument("--confidence-head", action="store_true",
                   help="DSpark: add a confidence head, trained to predict whether each draft is accepted")
    t.add_argument("--heads-only", action="store_true",
                   help="DSpark: train only the new heads; the --init drafter's backbone stays as it is")
    t.add_argument("--confidence-weight", type=_finite_float("--confidence-weight", positive=False), default=1.0,
                   help="weight of the confidence head's loss beside the drafts' cross-entropy")
    t.add_argument("--eval-every", type=_positive_int("--eval-every"), default=100)
    t.add_argument("--save-every", type=_positive_int("--save-every"), default=200)
    t.add_argument("--eval-samples", type=_positive_int("--eval-samples"), default=16,
                   help="held-out samples for the held-out tau (at most a tenth of the data; 64 anchors each)")
    t.add_argument("--tap-cache", default=None,
                   help="directory for the target's taps, computed online once (fp16) and read back in later "
                        "epochs and later runs on the same data (when the data has no taps of these layers)")
    t.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16: the drafter's forward and backward under CPU autocast (fp32 weights and "
                        "optimizer; faster where the CPU has AVX512-BF16 or AMX)")
    t.add_argument("--seed", type=_seed("--seed"), default=0)
    t.add_argument("--threads", type=_positive_int("--threads"), default=None)
    return parser


def cmd_train(args) -> int:
    import torch

    from loopspec.model.drafter import DSparkHeads
    from loopspec.pair import load_pair
    from loopspec.train.run import prepare_drafter, train_drafter
    from loopspec.train.trainer import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    heads = (DSparkHeads(markov_rank=args.markov_rank or 0, markov_head_type=args.markov_head,
                         confidence_head=args.confidence_head)
             if args.markov_rank or args.confidence_head else None)
    if args.loop_stages and args.markov_rank:
        raise LoopspecError("--loop-stages with --markov-rank is not implemented (a later stage's Markov chain "
                            "starts from a drafted anchor); train the Markov head with --loop-stages 0")
    pair = load_pair(args.target, args.init or "none", mask_token=args.mask_token_id)
    drafter, draft_vocab = prepare_drafter(
        pair, args.target, num_layers=args.num_layers, block_size=args.block_size,
        target_layer_ids=_int_list(args.tap_layers, "--tap-layers"), num_taps=args.num_taps,
        mask_token=args.mask_token_id, draft_vocab_size=args.draft_vocab_size, data_dir=args.data, seed=args.seed,
        heads=heads)
    cfg = TrainConfig(anchors=args.anchors, gamma=args.gamma, lr=args.lr, epochs=args.epochs,
                      batch_sequences=args.batch_sequences, dpace=args.dpace, kl_weight=args.kl_weight,
                      confidence_weight=args.confidence_weight, heads_only=args.heads_only,
                      causal_in_block=args.causal_in_block, loop_stages=args.loop_stages, eval_every=args.eval_every,
                      eval_samples=args.eval_samples, save_every=args.save_every, seed=args.seed, compute_dtype=args.compute_dtype)
    last = train_drafter(data_dir=args.data, target=pair.target, drafter=drafter, out_dir=args.out, cfg=cfg,
                         draft_vocab=draft_vocab, max_steps=args.max_steps,
                         max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                         stop_after_steps=args.stop_after_steps, tap_cache=args.tap_cache)
    print(json.dumps(last))
    return 0


def cmd_tune(args) -> int:
    from loopspec.runtime.bench import load_prompts
    from loopspec.runtime.pipeline import open_pipeline
    from loopspec.runtime.tune import choose, store_setting, sweep
    from loopspec.tuned import check_storable

    try:
        thresholds = [float(x) for x in args.thresholds.split(",") if x.strip()]
    except ValueError:
        raise LoopspecError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    stages = _int_list(args.stages, "--stages")
    if not thresholds or not stages or min(stages) < 1:
        raise LoopspecError("--thresholds and --stages need at least one value; stages >= 1")
    # what would fail only after the sweep is refused before it
    choice = _engine_choice(args)
    if not choice.names_a_drafter:
        raise LoopspecError("tune needs a drafter (got --drafter none)")
    _check_output_file(args.json_out, "--json")
    if not args.no_store:
        if args.onnx_dir or args.trt_dir:
            raise LoopspecError("an exported engine directory has no drafter directory to store a tuned setting "
                                "into: pass --no-store (and --json FILE to keep the result)")
        if args.drafter != "default":
            check_storable(args.drafter)
    texts = [t for f in args.prompts for t in load_prompts(f, args.limit)]
    pipe = open_pipeline(choice)
    if not pipe.engine.has_drafter:
        raise LoopspecError("tune needs a drafter")
    block_sizes = _int_list(args.block_sizes, "--block-sizes") or [pipe.engine.drafter_cfg.block_size]
    if min(block_sizes) < 2:
        raise LoopspecError("--block-sizes must be >= 2")
    tree_budgets = _int_list(args.tree_budgets, "--tree-budgets")
    if not tree_budgets or min(tree_budgets) < 0:
        raise LoopspecError("--tree-budgets needs at least one value; budgets >= 0")
    suffix_options = {"sweep": (False, True), "on": (True,), "off": (False,)}[args.suffix]
    suffix_firsts = _int_list(args.suffix_firsts, "--suffix-firsts")
    if any(m and not 2 <= m <= 6 for m in suffix_firsts):
        raise LoopspecError(f"--suffix-firsts takes 0 (off) or match lengths 2..6, got {args.suffix_firsts!r}")
    prompts = [pipe.encode(t) for t in texts]
    rows = sweep(pipe, prompts, thresholds=thresholds, stages=stages, block_sizes=block_sizes,
                 max_new_tokens=args.max_new_tokens, tree_budgets=tree_budgets, suffix_options=suffix_options,
                 suffix_firsts=suffix_firsts)
    print(f"{'k':>3} {'stages':>6} {'gate':>6} {'tree':>5} {'suffix':>6} {'first':>5} {'then':>4} {'nodes':>6} {'tau':>6} {'tok/s':>7}"
          f" {'speedup':>8} lossless")
    for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
        print(f"{r['block_size']:>3} {r['max_stages']:>6} {r['gate_threshold']:>6} {r['tree_budget']:>5}"
              f" {'on' if r['suffix'] else 'off':>6} {r['suffix_first'] or '-':>5}"
              f" {'yes' if r.get('suffix_then_draft') else '-':>4} {r['nodes_per_verification']:>6.1f} {r['tau']:>6.2f}"
              f" {r['tokens_per_s']:>7.1f} {r['speedup_vs_ar']:>7.2f}x {r['lossless']}")
    best = choose(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "best": best}, indent=2) + "\n")
    if not args.no_store:
        if pipe.drafter_dir is None:
            raise LoopspecError("the drafter was not loaded from a directory; nothing to store into")
        path = store_setting(pipe.drafter_dir, best, pipe.tuning_key)
        print(f"stored in {path} for {pipe.tuning_key}: block {best['block_size']}, "
              f"max stages {best['max_stages']}, gate {best['gate_threshold']}, tree budget {best['tree_budget']}, "
              f"suffix {'on' if best['suffix'] else 'off'}, suffix first {best['suffix_first'] or 'off'}"
              f"{', then the drafter' if best.get('suffix_then_draft') else ''}")
    return 0


def _engine_choice(args, **overrides):
    """The one value of which engine runs (loopspec.runtime.pipeline.EngineChoice), from the flags."""
    from loopspec.runtime.pipeline import EngineChoice

    flags = dict(target=args.target, drafter=args.drafter, backend=args.backend, precision=args.precision,
                 device=args.device, max_context=args.max_context, threads=args.threads,
                 cuda_graphs=args.cuda_graphs, onnx_dir=args.onnx_dir, trt_dir=args.trt_dir,
                 mask_token_id=args.mask_token_id)
    return EngineChoice(**(flags | overrides))


def _side_by_side(args) -> list:
    """--backend and --precision as comma lists: every (backend, precision) engine, the first the reference."""
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    if not backends or len(set(backends)) != len(backends):
        raise LoopspecError(f"--backend needs distinct backends, got {args.backend!r}")
    if not precisions or len(set(precisions)) != len(precisions):
        raise LoopspecError(f"--precision needs distinct precisions, got {args.precision!r}")
    return [_engine_choice(args, backend=b, precision=p) for b in backends for p in precisions]


def _sampling(args):
    from loopspec.decoding import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _int_list(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoopspecError(f"{name} must be comma-separated integers, got {text!r}") from None


def cmd_data(args) -> int:
    import torch

    from loopspec.model.target import default_target_layer_ids
    from loopspec.pair import load_pair
    from loopspec.prompts import read_conversations
    from loopspec.runtime import decoder
    from loopspec.train.data import build_data
    from loopspec.train.kept import pack_kept
    from loopspec.weights import target_fingerprint

    if args.pack:
        manifest = pack_kept(args.out, args.pack)
        size = (Path(args.pack) / "samples.jsonl.xz").stat().st_size
        print(f"{manifest['samples']} samples kept in {args.pack} ({size / 1e6:.2f} MB)")
        return 0
    if not args.prompts:
        raise LoopspecError("data needs --prompts (or --pack DIR to keep an existing data directory)")
    for path in args.prompts:  # a missing, malformed or non-UTF-8 file fails before the target loads
        read_conversations(path, args.limit)
    params = _sampling(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args.target, "none")
    target = pair.target
    taps = _int_list(args.tap_layers, "--tap-layers") or default_target_layer_ids(target.cfg.num_layers)
    target.set_taps(taps)
    manifest = build_data(prompt_files=args.prompts, target_dir=pair.target_dir, target=target,
                          tokenizer=pair.tokenizer, out_dir=args.out, stop_ids=set(pair.stop_token_ids),
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit,
                          max_prompt_tokens=args.max_prompt_tokens, params=params, seed=args.seed,
                          cache_taps=args.cache_taps, tap_layer_ids=taps,
                          target_hash=target_fingerprint(pair.target_dir), kept_dir=args.kept,
                          respond=decoder.regenerate_responses)  # the runtime's decoder, one row per prompt
    print(f"{manifest['samples']} samples in {args.out}")
    return 0


def cmd_prompts(args) -> int:
    import torch

    from loopspec.pair import load_pair
    from loopspec.runtime import decoder
    from loopspec.train.data import write_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args.target, "none")
    report = write_prompts(target=pair.target, tokenizer=pair.tokenizer, out_path=args.out, count=args.count,
                           stop_ids=set(pair.stop_token_ids),
                           params=_sampling(args),
                           seed=args.seed, max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                           starts_with=args.starts_with, respond=decoder.regenerate_responses)
    print(f"{report['prompts']} prompts in {args.out} ({report['written_this_run']} written this run from "
          f"{report['tries_this_run']} tries)")
    return 0


def cmd_generate(args) -> int:
    from loopspec.runtime.pipeline import open_pipeline
    from loopspec.settings import check_method

    params, choice = _sampling(args), _engine_choice(args)
    check_method(args.method, choice.names_a_drafter)
    if not args.prompt.strip():  # known before the model loads (Pipeline.encode refuses it too)
        raise LoopspecError("empty prompt")
    pipe = open_pipeline(choice)
    settings = pipe.settings(args.method, **_decoding_knobs(args))
    prompt_ids = pipe.encode(args.prompt, chat=args.chat)
    stream = TextStream(pipe)
    result = pipe.run(prompt_ids, settings, max_new_tokens=args.max_new_tokens, params=params, seed=args.seed,
                      on_tokens=stream)
    stream.flush()
    print()
    about = f"{settings.describe()}, {pipe.describe_engine()}"
    if settings.uses_drafter:
        about += f", drafter: {pipe.drafter_description}"
    if settings.method == "dloop":
        about += f", stages/verification {result.stats.stages_histogram}"
    if settings.tree_budget or settings.uses_suffix:
        nodes = result.stats.nodes_per_round
        about += (f", nodes/verification {sum(nodes) / max(len(nodes), 1):.1f}"
                  f", suffix-only tokens {result.stats.suffix_tokens}")
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
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)

    def flush(self) -> None:
        text = self.pipe.decode(self.tokens)
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()


def cmd_serve(args) -> int:
    from loopspec.runtime.pipeline import open_pipeline
    from loopspec.runtime.server import ServeConfig, serve
    from loopspec.settings import check_method
    from loopspec.weights import DEFAULT_TARGET_NAME

    if not args.request_timeout > 0:
        raise LoopspecError(f"--request-timeout must be > 0, got {args.request_timeout}")
    choice = _engine_choice(args)
    check_method(args.method, choice.names_a_drafter)
    pipe = open_pipeline(choice)
    settings = pipe.settings(args.method, **_decoding_knobs(args))
    source = Path(args.onnx_dir or args.trt_dir or args.target)
    name = args.model_name or (DEFAULT_TARGET_NAME if source == Path("default") else
                               source.stem if source.suffix == ".gguf" else source.resolve().name)
    config = ServeConfig(settings=settings, model_name=name, max_batch_size=args.max_batch_size,
                         max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                         max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                         prefill_chunk=args.prefill_chunk)
    serve(pipe, host=args.host, port=args.port, config=config, log_level=args.log_level)
    return 0


def cmd_bench(args) -> int:
    from loopspec.runtime.bench import BenchOutput, BenchPlan, run_bench

    _check_output_file(args.json_out, "--json")
    plan = BenchPlan(prompt_sets=args.prompts, methods=[m.strip() for m in args.methods.split(",") if m.strip()],
                     limit=args.limit, max_new_tokens=args.max_new_tokens, all_turns=args.all_turns, chat=args.chat,
                     params=_sampling(args), seed=args.seed, repeats=args.repeats, cost_model=args.cost_model,
                     llama_server=args.llama_server)
    run_bench(plan, _side_by_side(args), _decoding_knobs(args),
              BenchOutput(json_out=args.json_out, out_dir=args.out_dir, command="loopspec " + shlex.join(args.argv)))
    return 0


def _add_convert_onnx_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct), an HF checkpoint dir or a .gguf file")
    p.add_argument("--drafter", default="default",
                   help="'default', a z-lab DFlash drafter dir, or 'none' (the target engine alone: ar only)")
    p.add_argument("--out", required=True, help="artifact directory (an earlier export there is replaced)")
    p.add_argument("--max-context", type=_positive_int("--max-context"), default=None,
                   help="largest context in the engine specs' ranges (default: the models' max positions)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token for a drafter whose config has none")
    p.add_argument("--threads", type=_positive_int("--threads"), default=None, help="CPU threads")
    p.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True,
                   help="check every engine against the PyTorch reference (default on)")
    p.add_argument("--precision", default="fp32", choices=PAIR_PRECISIONS,
                   help="fp32 (default) | gguf-fp32act | gguf-int8act: the target's matrices as its GGUF's own "
                        "Q4_1/Q8_0 blocks (ONNX Runtime MatMulNBits) with fp32 or int8 activations "
                        "(--target default or FILE.gguf)")


def cmd_convert_onnx(args) -> int:
    import torch

    from loopspec.convert.onnx_export import convert_onnx
    from loopspec.convert.validate import format_report
    from loopspec.pair import load_pair
    from loopspec.weights import target_gguf_path

    if args.threads:
        torch.set_num_threads(args.threads)
    gguf_path = target_gguf_path(args.target) if args.precision != "fp32" else None  # before the slow load
    pair = load_pair(args.target, args.drafter, mask_token=args.mask_token_id)  # as generate resolves it
    manifest, report = convert_onnx(pair.target, pair.drafter, args.out, target_dir=pair.target_dir,
                                    drafter_dir=pair.drafter_dir, max_context=args.max_context,
                                    validate=args.validate, num_threads=args.threads, precision=args.precision,
                                    gguf_path=gguf_path)
    print(f"exported {', '.join(manifest.engines)} ({manifest.precision}) to {args.out}")
    if report is not None:
        print(format_report(report))
        if not report["passed"]:
            raise LoopspecError(f"validation failed (the report is in {Path(args.out) / 'manifest.json'})")
    return 0


def _add_convert_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", required=True, help=" | ".join(QUANTIZED_PRECISIONS))
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct), an HF checkpoint dir or a .gguf file")
    p.add_argument("--drafter", default="default", help="'default' or a trained z-lab DFlash drafter dir")
    p.add_argument("--out", required=True,
                   help="output directory: drafter/, target/ (--target-too), onnx/, quantize.json; replaced only "
                        "by artifacts that pass validation (failed ones are kept in OUT.rejected/, exit code 2)")
    p.add_argument("--calib-prompts", default=None, help="JSONL of {\"turns\": [...]} (default: built-in prompts)")
    p.add_argument("--calib-size", type=_positive_int("--calib-size"), default=16, help="calibration prompts")
    p.add_argument("--target-too", action="store_true", help="also quantize the target (checkpoint and ONNX graph)")
    p.add_argument("--max-context", type=_positive_int("--max-context"), default=None,
                   help="largest context in the engine specs' ranges (default: the models' max positions)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token for a drafter whose config has none")
    p.add_argument("--threads", type=_positive_int("--threads"), default=None, help="CPU threads")
    p.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True,
                   help="fp8: measure the ONNX Runtime engines against the fp32 reference; a failed check "
                        "leaves --out unchanged and exits 2 (default on)")


def cmd_convert_quantize(args) -> int:
    from loopspec.convert.quantize import ValidationFailed, format_quantize_report, quantize_pair

    try:
        report = quantize_pair(target=args.target, drafter=args.drafter, out_dir=args.out, precision=args.precision,
                               calib_prompts=args.calib_prompts, calib_size=args.calib_size,
                               target_too=args.target_too, max_context=args.max_context,
                               mask_token_id=args.mask_token_id, validate=args.validate, num_threads=args.threads)
    except ValidationFailed as e:
        print(format_quantize_report(e.report, e.path))  # the full report, then the one-line error
        raise
    print(format_quantize_report(report, args.out))
    return 0


def _add_convert_trt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--onnx", required=True, help="ONNX artifact directory (`convert onnx`, or `convert quantize`'s onnx/)")
    p.add_argument("--out", required=True, help="plan directory (an earlier build there is replaced)")
    p.add_argument("--precision", default=None,
                   help="fp32 | fp8 | nvfp4: require graphs of this precision (default: the graphs' own)")
    p.add_argument("--workspace-gb", type=float, default=None, help="TensorRT builder workspace limit")
    p.add_argument("--max-batch", type=_positive_int("--max-batch"), default=None,
                   help="rows per engine call the plans take (default: the ONNX export's, 16); "
                        "TensorRT sizes its memory for the largest")


def cmd_convert_trt(args) -> int:
    from loopspec.convert.trt import build_plans

    manifest = build_plans(args.onnx, args.out, precision=args.precision, workspace_gb=args.workspace_gb,
                           max_batch=args.max_batch)
    settings = manifest.data["settings"]
    print(f"built {', '.join(manifest.engines)} ({manifest.precision}) TensorRT plans for {settings['device']} "
          f"(compute capability {settings['compute_capability']}) in {args.out}")
    return 0


def _add_convert_bundle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True,
                   help="trtllm | vllm | sglang | llamacpp, a comma-separated list, or all (every engine that can "
                        "serve the target: llamacpp needs a GGUF target, 'default' or a .gguf file)")
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct), an HF checkpoint dir or a .gguf file")
    p.add_argument("--drafter", default="default", help="'default' (the shipped drafter), a z-lab DFlash drafter dir, or a DSpark "
                        "drafter dir (DeepSpec's format: vLLM and llama.cpp only)")
    p.add_argument("--out", required=True, help="bundle directory (an earlier bundle there is replaced)")
    p.add_argument("--precision", default=None,
                   help="fp8 | nvfp4: a modelopt-quantized target (NVFP4 runs on Blackwell GPUs only)")
    p.add_argument("--tp", type=_positive_int("--tp"), default=1, help="tensor-parallel size of every launch")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32: the unquantized weights")
    p.add_argument("--max-batch-size", type=_positive_int("--max-batch-size"), default=8,
                   help="requests decoding at once: TensorRT-LLM max_batch_size and cuda_graph_config.max_batch_size, "
                        "vLLM --max-num-seqs, SGLang --max-running-requests (default 8)")
    p.add_argument("--max-context", type=_positive_int("--max-context"), default=None,
                   help="tokens per request, prompt + output: TensorRT-LLM max_seq_len (and max_num_tokens, with "
                        "--max-batch-size), vLLM --max-model-len, SGLang --context-length, llama-server -c "
                        "(default: 4096, or the target's maximum if smaller)")
    p.add_argument("--threads", type=_positive_int("--threads"), default=None,
                   help="llamacpp: llama-server's -t in its launch script (default: all cores; THREADS overrides it)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token for a drafter whose config has none")
    p.add_argument("--calib-prompts", default=None, help="--precision: JSONL of {\"turns\": [...]} (default: built-in)")
    p.add_argument("--calib-size", type=_positive_int("--calib-size"), default=None, help="--precision: calibration prompts")


def cmd_convert_bundle(args) -> int:
    from loopspec.convert.bundle import ENGINE_NAMES, build_bundle

    manifest = build_bundle(args.target, args.drafter, args.out, args.engine, precision=args.precision, tp=args.tp,
                            dtype=args.dtype, mask_token_id=args.mask_token_id, max_batch_size=args.max_batch_size,
                            max_context=args.max_context, calib_prompts=args.calib_prompts, calib_size=args.calib_size,
                            threads=args.threads)
    print(f"serving bundle ({manifest['precision']}, tensor parallel {manifest['tensor_parallel_size']}) in {args.out}")
    for engine in manifest["engines"]:
        print(f"  {ENGINE_NAMES[engine]}: sh {Path(args.out) / engine / 'launch.sh'}")
    if args.precision == "nvfp4":
        print("  NVFP4 runs only on Blackwell GPUs (compute capability >= 10.0)")
    return 0


# stage → (help, arguments, command): `loopspec convert <stage>`
CONVERT_STAGES = {
    "onnx": ("export the target (+ drafter) engines as ONNX (fp32, or the target over its GGUF blocks), with "
             "manifest.json, and validate them",
             _add_convert_onnx_args, cmd_convert_onnx),
    "quantize": ("modelopt FP8 / NVFP4 calibration of the drafter (and target): HF checkpoints + ONNX engines",
                 _add_convert_quantize_args, cmd_convert_quantize),
    "trt": ("build TensorRT plans from ONNX engines (needs TensorRT and an NVIDIA GPU)",
            _add_convert_trt_args, cmd_convert_trt),
    "bundle": ("a TensorRT-LLM / vLLM / SGLang / llama.cpp serving bundle: z-lab drafter (a DSpark drafter: vLLM "
               "and llama.cpp), HF target (or the drafter as a llama.cpp GGUF beside the target GGUF), launch files",
               _add_convert_bundle_args, cmd_convert_bundle),
}


def cmd_convert(args) -> int:
    return CONVERT_STAGES[args.stage][2](args)


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "tune": cmd_tune, "prompts": cmd_prompts, "data": cmd_data,
            "train": cmd_train, "serve": cmd_serve, "convert": cmd_convert}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 with one line for malformed flags
    args.argv = list(sys.argv[1:] if argv is None else argv)  # reports record the exact command
    try:
        return COMMANDS[args.command](args)
    except LoopspecError as e:
        print(f"loopspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loopspec: interrupted", file=sys.stderr)
        return 130
