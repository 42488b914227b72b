"""Serving bundles: TensorRT-LLM, vLLM and SGLang serve the target with the DFlash drafter in the z-lab
format they all load; llama.cpp serves a GGUF target with the drafter as a llama.cpp `dflash` GGUF.
A DSpark drafter (Markov / confidence heads) goes to the engines that run its heads: vLLM (DeepSpec's
`Qwen3DSparkModel` layout, method `dspark`) and llama.cpp (the dflash GGUF with the heads, draft-dspark).

A bundle directory holds
  drafter/    z-lab config.json + model.safetensors, full draft vocabulary (what every engine reads);
              for a DSpark drafter DeepSpec's config.json and key names instead (what vLLM reads)
  target/     Hugging Face checkpoint (config.json, *.safetensors, tokenizer files), optionally
              modelopt-quantized (FP8 / NVFP4)
  trtllm/     extra_llm_api_options.yaml + launch.sh      (only the engines asked for)
  vllm/       launch.sh (+ drafter/: the drafter with its reduced draft vocabulary, when it has one)
  sglang/     launch.sh
  llamacpp/   target.gguf (a copy of the target GGUF), drafter.gguf, launch.sh
  README.md   what each engine uses, how to launch, the support matrix
  manifest.json  sha256 of every file, source hashes, tool versions

drafter/ and target/ are written only when an engine that reads them is asked for; a llama.cpp-only
bundle holds llamacpp/ (with the README and manifest) alone.

Launch scripts cd into the bundle root and use relative paths (`./target`, `./drafter`), so a bundle
can be copied to the serving machine as it is. DLoop runs only in loopspec's own runtime.

Engine facts this module relies on (from each engine's source and documentation; re-check on upgrades):
- TensorRT-LLM >= 1.3, LLM API reference `DFlashDecodingConfig`: `speculative_config` with
  `decoding_type: DFlash`, `speculative_model`, `max_draft_len` (drafted tokens per step, at most
  block_size - 1), `mask_token_id`, `target_layer_ids`; `CudaGraphConfig` (`enable_padding`,
  `max_batch_size`); `tensor_parallel_size`, `max_batch_size`, `max_seq_len`, `max_num_tokens` are
  LLM API arguments. trtllm-serve (tensorrt_llm/commands/serve.py) reads that YAML with `--config`,
  alias `--extra_llm_api_options` (the older spelling, accepted by every 1.x), and applies it AFTER its
  own flags (`update_llm_args_with_extra_dict`): the YAML wins, so tensor parallelism is set there
  only, never also as `--tp_size`. `--served-model-name` names the model in /v1/models (TensorRT-LLM
  pull request 11711; without it the name is the model directory's). The DFlash worker sizes its
  drafter context arena from max_batch_size + 1 slots x max_seq_len (speculative/dflash.py), so both
  are always written: the defaults (2048 requests, the model's whole context) fill small GPUs.
- vLLM (speculative decoding docs; z-lab/dflash README; vllm/model_executor/models/qwen3_dflash.py):
  `vllm serve TARGET --speculative-config '{"method": "dflash", "model": DRAFTER,
  "num_speculative_tokens": k - 1}'`, `--tensor-parallel-size N`, `--max-model-len`,
  `--max-num-seqs`, `--served-model-name`; the mask token and tap layers come from the drafter's
  config.json (`dflash_config`). A reduced draft vocabulary is read as `draft_vocab_size` (config.json),
  a `d2t` tensor (target id = draft id + d2t) and the drafter's own `lm_head.weight` of
  draft_vocab_size rows, from any *.safetensors file in the drafter directory. A modelopt
  checkpoint's quantization is read from the target's config.
- SGLang (docs.sglang.io speculative decoding; z-lab model cards): `python -m sglang.launch_server
  --model-path TARGET --speculative-algorithm DFLASH --speculative-draft-model-path DRAFTER
  --speculative-num-draft-tokens k` (the block size, anchor included; newer releases also spell it
  `--speculative-dflash-block-size` and require both to agree when both are set), `--tp-size N`,
  `--context-length`, `--max-running-requests`, `--served-model-name`;
  `--speculative-draft-model-quantization unquant` keeps the drafter unquantized when the target is.
- llama.cpp (the version vendored by llama-cpp-python 0.3.36): see loopspec/engines/llamacpp.py for
  the dflash GGUF and the llama-server command; it needs the target as a GGUF file.
- vLLM's DSpark (vllm/config/speculative.py, vllm/model_executor/models/qwen3_dspark.py): the method is
  `dspark`, detected from `architectures: ["Qwen3DSparkModel"]` and also given explicitly here;
  `num_speculative_tokens` is the block size, since the block [anchor, mask x (k-1)] yields k drafts
  (every position drafts the token after it: DeepSpec's convention). The mask token and taps are read
  from `dflash_config`, else the top level. Its Markov head has `markov_w1` / `markov_w2` only (the
  vanilla head; `markov_head_type` is not read, so another head would be run as vanilla), the
  confidence head is `confidence_head.proj` (with bias) over [h ; W1[prev]] or h by
  `confidence_head_with_markov`. `load_weights` prefixes `model.` to DeepSpec's bare names; the
  `embed_tokens` / `lm_head` copies DeepSpec saves are optional (the target's are shared when absent),
  so drafter/ leaves them out. A reduced draft vocabulary is `draft_vocab_size`, `d2t`, an `lm_head` of
  the draft rows and a `markov_w2` of the draft rows (its bias is computed over the draft vocabulary).
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from loopspec.defaults import DEFAULT_DRAFTER_DIR, DEFAULT_TARGET_MASK_TOKEN_ID
from loopspec.engines.llamacpp import (cached_drafter_gguf, gguf_target_info, llama_server_command, spec_type,
                                       unsupported_in_llamacpp)
from loopspec.engines.staging import check_out_dir, staged_dir
from loopspec.errors import LoopspecError
from loopspec.precisions import precision_names
from loopspec.model.drafter import Drafter, DrafterConfig, check_fits, drafter_kind, resolve_mask_token_id
from loopspec.model.target import TargetConfig
from loopspec.weights import (DEFAULT_TARGET_NAME, file_sha256, load_tokenizer, read_json, read_safetensors,
                              resolve_target_dir, target_fingerprint, target_gguf_path, write_safetensors)

HF_ENGINES = ("trtllm", "vllm", "sglang")  # serve the HF checkpoint in target/ with the z-lab drafter/
ENGINES = HF_ENGINES + ("llamacpp",)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PRECISIONS = precision_names(weights=("modelopt",))  # quantized checkpoints a bundle can carry
# what an engine needs beside the weights to serve the target (chat template, stop tokens, tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
ENGINE_NAMES = {"trtllm": "TensorRT-LLM >= 1.3", "vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}

DEFAULT_MAX_CONTEXT = 4096  # tokens per request (prompt + output), capped at the target's own maximum
VLLM_DRAFTER = "vllm/drafter"  # the reduced-vocabulary drafter, for vLLM
LLAMACPP_TARGET = "llamacpp/target.gguf"
LLAMACPP_DRAFTER = "llamacpp/drafter.gguf"  # f32, with the reduced draft vocabulary when it has one
# engines that draft over the drafter's reduced vocabulary (d2t) when it has one
REDUCED_VOCAB_ENGINES = ("vllm", "llamacpp")
# Why an engine drafts over the full vocabulary although the drafter was trained on a reduced one
# (checked against the engines' sources; see docs/serving.md).
FULL_VOCAB_REASONS = {
    "trtllm": ("TensorRT-LLM's DFlash drafter always takes the target's lm_head (full vocabulary) when it "
               "loads, and the backbone it builds has no d2t, so the worker's d2t lookup finds none; it also "
               "reads draft_vocab_size from the drafter's config.json to size its tensor-parallel gather and "
               "rejection-sampling buffers, so drafter/ carries neither d2t nor draft_vocab_size."),
    "sglang": ("SGLang's DFLASH drafter has no lm_head of its own: it drafts with the target's lm_head over "
               "the full vocabulary and ignores a d2t tensor."),
}

# Which engine supports what, declared once (README and docs/serving.md print it).
SUPPORT_COLUMNS = ("DFlash", "DLoop", "d2t reduced vocab", "FP8", "NVFP4", "tensor parallel")
SUPPORT = {
    "loopspec runtime": ("yes", "yes", "yes", "drafter (ONNX Runtime / TensorRT)", "TensorRT on Blackwell",
                         "no (one device)"),
    "TensorRT-LLM >= 1.3": ("yes (`DFlashDecodingConfig`)", "no", "no (full vocab)",
                            "yes (modelopt checkpoint)", "Blackwell only", "yes (`tensor_parallel_size`)"),
    "vLLM": ("yes (`method: dflash`)", "no", "yes (`draft_vocab_size` + `d2t`)", "yes (modelopt checkpoint)",
             "Blackwell only", "yes (`--tensor-parallel-size`)"),
    "SGLang": ("yes (`DFLASH`)", "no", "no (full vocab)", "yes (modelopt checkpoint)", "Blackwell only",
               "yes (`--tp-size`)"),
    "llama.cpp": ("yes (`--spec-type draft-dflash`)", "no", "yes (`d2t` + the draft's own `output` head)",
                  "no (the target's own GGUF quantization)", "no", "no (one process)"),
}


def unsupported_in_vllm(cfg: DrafterConfig) -> str | None:
    """Why vLLM cannot run this drafter as written (None: it can)."""
    if not (cfg.anchor_predicts or cfg.is_dspark):
        return None  # z-lab DFlash: method dflash
    if not cfg.anchor_predicts:
        return ("vLLM's DSpark drafts from the anchor's own block position (DeepSpec's block convention: position "
                "i drafts the token at anchor+i+1), and this drafter's heads were trained in z-lab's (position i "
                "drafts the token at anchor+i): vLLM would draft one position off")
    if not cfg.markov_rank:
        return ("vLLM's Qwen3 DSpark model always builds a Markov head, and this drafter has none (markov_rank 0) "
                "to load into it")
    if cfg.markov_head_type != "vanilla":
        return (f"vLLM's DSpark Markov head is the vanilla one only (markov_w1, markov_w2), not this drafter's "
                f"{cfg.markov_head_type} head")
    return None


def unsupported_in(cfg: DrafterConfig, engine: str) -> str | None:
    """Why `engine` cannot serve this drafter (None: it can)."""
    if engine == "vllm":
        return unsupported_in_vllm(cfg)
    if engine == "llamacpp":
        return unsupported_in_llamacpp(cfg)
    if cfg.anchor_predicts or cfg.is_dspark:
        return (f"the {ENGINE_NAMES[engine]} bundle carries z-lab DFlash drafters only (block_size - 1 drafts from "
                "block positions 1.., no head after the lm_head)")
    return None


def engines_for(cfg: DrafterConfig, engines: list[str], every: bool) -> list[str]:
    """The engines of `engines` that serve this drafter: with `every` ('all'), those that can; otherwise
    all of them, or a one-line refusal naming the first that cannot and why."""
    usable = [e for e in engines if unsupported_in(cfg, e) is None]
    if every and usable:
        return usable
    for engine in engines:
        why = unsupported_in(cfg, engine)
        if why:
            able = [ENGINE_NAMES[e] for e in ENGINES if unsupported_in(cfg, e) is None]
            raise LoopspecError(f"{ENGINE_NAMES[engine]} cannot serve this {drafter_kind(cfg)} drafter: {why}"
                                + (f" (engines that can: {', '.join(able)})" if able else ""))
    return engines


def support_matrix_markdown() -> str:
    lines = ["| engine | " + " | ".join(SUPPORT_COLUMNS) + " |", "|---" * (len(SUPPORT_COLUMNS) + 1) + "|"]
    lines += [f"| {engine} | " + " | ".join(row) + " |" for engine, row in SUPPORT.items()]
    return "\n".join(lines)


@dataclass
class LaunchSettings:
    """What every engine's launch needs to know about the pair."""

    name: str  # served model name
    tp: int
    block_size: int
    drafts: int  # drafts per verification: block_size - 1 (z-lab's convention) or block_size (DeepSpec's)
    mask_token_id: int
    target_layer_ids: list[int]
    precision: str | None
    max_batch_size: int  # requests decoding at once
    max_context: int  # tokens per request, prompt + output
    vllm_drafter: str = "./drafter"  # ./vllm/drafter when the drafter has a reduced draft vocabulary
    llamacpp_threads: int | None = None  # llama-server's -t default in the launch script (None: all cores)
    vllm_method: str = "dflash"  # dspark for a DSpark drafter
    llamacpp_spec: str = "draft-dflash"  # llama-server's --spec-type: draft-dspark runs the Markov head

    @property
    def max_num_tokens(self) -> int:
        """Tokens one forward may carry: a whole prompt of max_context, or every request's block."""
        return max(self.max_context, self.max_batch_size * self.block_size)


# --------------------------------------------------------------------------------------------------
# launch files per engine: {relative path: text}


def _quote(word: str) -> str:
    """A shell word: a script variable ("$PORT") expanded in double quotes, anything else quoted as is."""
    if len(word) > 1 and word[0] == "$" and word[1:].replace("_", "").isalnum():
        return f'"{word}"'
    return shlex.quote(word)


def _command(argv: list[str]) -> str:
    """A shell command: the program and its positional words on the first line, then one flag (and its
    value) per line, every argument quoted; extra flags given to the script pass through ("$@")."""
    i = 0
    while i < len(argv) and not argv[i].startswith("--"):
        i += 1
    lines = [" ".join(_quote(a) for a in argv[:i])]
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{argv[i]} {_quote(argv[i + 1])}")
            i += 2
        else:
            lines.append(_quote(argv[i]))
            i += 1
    return "exec " + " \\\n    ".join(lines + ['"$@"']) + "\n"


def _launch_script(engine: str, argv: list[str], settings: str = "") -> str:
    return ("#!/bin/sh\n"
            f"# Serve this bundle with {ENGINE_NAMES[engine]}: target + drafter. Extra flags are passed on.\n"
            "set -eu\n"
            'cd "$(dirname "$0")/.."  # paths below are relative to the bundle root\n'
            + settings + _command(argv))


def trtllm_options(s: LaunchSettings) -> dict:
    """The LLM API options trtllm-serve reads from YAML."""
    spec = {"decoding_type": "DFlash", "speculative_model": "./drafter", "max_draft_len": s.block_size - 1,
            "mask_token_id": s.mask_token_id, "target_layer_ids": list(s.target_layer_ids)}
    return {"tensor_parallel_size": s.tp, "max_batch_size": s.max_batch_size, "max_seq_len": s.max_context,
            "max_num_tokens": s.max_num_tokens,
            "cuda_graph_config": {"enable_padding": True, "max_batch_size": s.max_batch_size},
            "speculative_config": spec}


def trtllm_files(s: LaunchSettings) -> dict[str, str]:
    import yaml  # PyYAML comes with transformers

    options = "# TensorRT-LLM LLM API options (trtllm-serve --extra_llm_api_options / --config)\n"
    options += yaml.safe_dump(trtllm_options(s), sort_keys=False)
    # no --tp_size: the YAML's tensor_parallel_size is the one trtllm-serve applies (it overrides flags)
    argv = ["trtllm-serve", "./target", "--backend", "pytorch", "--served-model-name", s.name,
            "--extra_llm_api_options", "./trtllm/extra_llm_api_options.yaml"]
    return {"trtllm/extra_llm_api_options.yaml": options, "trtllm/launch.sh": _launch_script("trtllm", argv)}


def vllm_speculative_config(s: LaunchSettings) -> dict:
    return {"method": s.vllm_method, "model": s.vllm_drafter, "num_speculative_tokens": s.drafts}


def vllm_files(s: LaunchSettings) -> dict[str, str]:
    argv = ["vllm", "serve", "./target", "--served-model-name", s.name, "--tensor-parallel-size", str(s.tp),
            "--max-model-len", str(s.max_context), "--max-num-seqs", str(s.max_batch_size),
            "--speculative-config", json.dumps(vllm_speculative_config(s))]
    return {"vllm/launch.sh": _launch_script("vllm", argv)}


def sglang_files(s: LaunchSettings) -> dict[str, str]:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "./target", "--served-model-name", s.name,
            "--tp-size", str(s.tp), "--context-length", str(s.max_context),
            "--max-running-requests", str(s.max_batch_size), "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", "./drafter", "--speculative-num-draft-tokens", str(s.block_size)]
    if s.precision is not None:  # SGLang quantizes the drafter like the target unless told otherwise
        argv += ["--speculative-draft-model-quantization", "unquant"]
    return {"sglang/launch.sh": _launch_script("sglang", argv)}


def llamacpp_files(s: LaunchSettings) -> dict[str, str]:
    threads = str(s.llamacpp_threads) if s.llamacpp_threads else "$(nproc 2>/dev/null || echo 4)"
    settings = ("# LLAMA_SERVER: the llama-server binary (default: llama-server on PATH; "
                "scripts/build_llama_server.sh builds one)\n"
                'LLAMA_SERVER="${LLAMA_SERVER:-llama-server}"\n'
                f'THREADS="${{THREADS:-{threads}}}"\n'
                'HOST="${HOST:-127.0.0.1}"\n'
                'PORT="${PORT:-8080}"\n')
    # llama.cpp drafts at most the drafter's drafts per block
    argv = llama_server_command("$LLAMA_SERVER", f"./{LLAMACPP_TARGET}", drafter_gguf=f"./{LLAMACPP_DRAFTER}",
                                draft_max=s.drafts, threads="$THREADS", context=s.max_context,
                                host="$HOST", port="$PORT", spec=s.llamacpp_spec)
    argv += ["--alias", s.name]
    return {"llamacpp/launch.sh": _launch_script("llamacpp", argv, settings)}


LAUNCH_FILES = {"trtllm": trtllm_files, "vllm": vllm_files, "sglang": sglang_files, "llamacpp": llamacpp_files}


# --------------------------------------------------------------------------------------------------
# inputs


def parse_engines(text: str | list[str], gguf_target: bool = True) -> list[str]:
    """'trtllm', 'vllm,sglang' or 'all' → engine names in a fixed order. 'all' is every engine that can
    serve the target: llama.cpp only when the target is a GGUF file (`gguf_target`)."""
    names = text if isinstance(text, list) else [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(ENGINES if gguf_target else HF_ENGINES)
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise LoopspecError(f"unknown engine {', '.join(unknown) or repr(text)} (choose from {', '.join(ENGINES)} or all)")
    return [e for e in ENGINES if e in names]


def check_tp(tp: int, heads: int, kv_heads: int, what: str) -> None:
    """Attention heads are split across GPUs; K/V heads are split or replicated evenly."""
    if tp < 1:
        raise LoopspecError(f"--tp must be >= 1, got {tp}")
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise LoopspecError(f"tensor parallel size {tp} does not split the {what}'s {heads} attention heads / "
                            f"{kv_heads} K/V heads evenly")


def resolve_max_context(max_context: int | None, limit: int) -> int:
    """The engines' per-request token limit: the given one, else DEFAULT_MAX_CONTEXT within the target's
    `limit` positions."""
    if max_context is None:
        return min(DEFAULT_MAX_CONTEXT, limit)
    if max_context < 1 or max_context > limit:
        raise LoopspecError(f"max context must be between 1 and the target's {limit} positions, got {max_context}")
    return max_context


HF_ONLY_OPTIONS = ("--tp and --precision apply to TensorRT-LLM, vLLM and SGLang; llama.cpp serves the target GGUF "
                   "as it is, in one process")
LLAMACPP_NEEDS_GGUF = ("llama.cpp serves a GGUF target, and {target} is a checkpoint directory: pass --target "
                       "default or a .gguf file (llama.cpp's convert_hf_to_gguf.py makes one from a Hugging Face "
                       "checkpoint), or leave llamacpp out of --engine")


def _gguf_target(target: str) -> Path | None:
    """The target's GGUF file ('default' or a .gguf file); None for a checkpoint directory."""
    if str(target) == "default":
        return target_gguf_path(target)
    path = Path(target)
    return path if path.is_file() and path.suffix == ".gguf" else None


def _resolve_drafter(drafter: str, target: str) -> Path:
    if drafter == "default":
        if str(target) != "default" or not DEFAULT_DRAFTER_DIR.is_dir():
            raise LoopspecError("a bundle needs a trained drafter: pass --drafter DIR (the shipped one fits "
                                "only --target default)")
        return DEFAULT_DRAFTER_DIR
    return Path(drafter)


# --------------------------------------------------------------------------------------------------
# writing


def export_target(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """Copy an HF checkpoint shard by shard, floats cast to `dtype` (one shard in memory at a time)."""
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise LoopspecError(f"no *.safetensors file in {src}")
    dst.mkdir(parents=True)
    for shard in shards:
        state = read_safetensors(shard)
        write_safetensors({k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in state.items()},
                          dst / shard.name)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shutil.copyfile(index, dst / index.name)
    cfg = with_rope_theta(read_json(src / "config.json", "target config"))
    name = str(dtype).removeprefix("torch.")
    cfg["torch_dtype"] = name
    if "dtype" in cfg:
        cfg["dtype"] = name
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not any(f.startswith("tokenizer") for f in copied):
        raise LoopspecError(f"the target {src} has no tokenizer files; the engines need them")
    for f in copied:
        shutil.copyfile(src / f, dst / f)


def with_rope_theta(cfg: dict) -> dict:
    """A transformers-5 config (θ only inside `rope_parameters`) with `rope_theta` beside it: engines
    built on transformers 4 read θ from `rope_theta` and would otherwise fall back to 10000."""
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if cfg.get("rope_theta") is None and theta is not None:
        cfg = {**cfg, "rope_theta": theta}
    return cfg


def add_rope_theta(config_path: Path) -> None:
    config_path.write_text(json.dumps(with_rope_theta(read_json(config_path, "target config")), indent=2) + "\n")


def target_lm_head(target_dir: Path, tied: bool) -> torch.Tensor:
    """The target's output projection [V, H] (its embedding when tied), read from the one shard holding it."""
    from safetensors import safe_open

    names = ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",)
    for shard in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    raise LoopspecError(f"the target {target_dir} has no {names[0]} tensor")


def write_vllm_drafter(model: Drafter, draft_ids: torch.Tensor, lm_head: torch.Tensor, dst: Path,
                       dtype: torch.dtype) -> None:
    """The drafter as vLLM's DFlash model reads a reduced draft vocabulary: `draft_vocab_size` in
    config.json, `d2t` (target id = draft id + d2t) and its own lm_head of the draft rows."""
    model.save(dst, dtype=dtype)
    cfg = read_json(dst / "config.json", "drafter config")
    cfg["draft_vocab_size"] = int(draft_ids.numel())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_safetensors({"d2t": (draft_ids - torch.arange(draft_ids.numel())).to(torch.int64)}, dst / "d2t.safetensors")
    write_safetensors({"lm_head.weight": lm_head[draft_ids].to(dtype).contiguous()}, dst / "lm_head.safetensors")
    if model.markov_head is not None:  # vLLM's DSpark adds the Markov bias over the draft rows: W2 of those rows
        state = read_safetensors(dst / "model.safetensors")
        name = "markov_head.markov_w2.weight"
        state[name] = state[name][draft_ids].contiguous()
        write_safetensors(state, dst / "model.safetensors")


def draft_vocab_per_engine(engines: list[str], draft_vocab_size: int | None) -> dict:
    """{engine: draft vocabulary it drafts over}: the reduced size where the bundle carries it, else "full"."""
    return {e: draft_vocab_size if draft_vocab_size and e in REDUCED_VOCAB_ENGINES else "full" for e in engines}


def quantize_target(src: Path, dst: Path, precision: str, calib_prompts: str | None = None,
                    calib_size: int | None = None) -> None:
    """A modelopt-quantized HF checkpoint of the target (convert/quantize.py does the calibration)."""
    from loopspec.convert.quantize import quantize_target_checkpoint

    options = {"calib_prompts": calib_prompts} | ({"calib_size": calib_size} if calib_size else {})
    quantize_target_checkpoint(src, dst, precision, **options)
    add_rope_theta(dst / "config.json")


def _draft_vocab_lines(engines: list[str], vocab: int | None) -> list[str]:
    if not vocab:
        return ["- Draft vocabulary: full (the drafter was trained on the whole vocabulary)."]
    lines = [f"- Draft vocabulary: the drafter was trained with a reduced draft vocabulary of {vocab} tokens "
             "(`d2t`). Drafting over the full vocabulary instead keeps the output exact (verification "
             "decides) but can lower τ a little."]
    if "vllm" in engines:
        lines.append(f"  - vLLM: reduced, from `{VLLM_DRAFTER}/` (`draft_vocab_size: {vocab}` in config.json, "
                     "`d2t.safetensors`, and `lm_head.safetensors` with the target's lm_head rows of the draft "
                     "tokens, since vLLM's DFlash model computes draft logits with its own head of that size).")
    if "llamacpp" in engines:
        lines.append(f"  - llama.cpp: reduced, in `{LLAMACPP_DRAFTER}` (the `d2t` tensor of absolute target ids "
                     "and the draft's own `output` head: the target's lm_head rows of the draft tokens).")
    for engine in engines:
        if engine in FULL_VOCAB_REASONS:
            lines.append(f"  - {ENGINE_NAMES[engine]}: full, from `drafter/`. {FULL_VOCAB_REASONS[engine]}")
    return lines


def _llamacpp_readme_lines(s: LaunchSettings) -> list[str]:
    return ["", f"`llamacpp/launch.sh` runs llama-server (`$LLAMA_SERVER`, else `llama-server` on PATH) on "
            f"`{LLAMACPP_TARGET}` (a copy of the target GGUF) with the drafter `{LLAMACPP_DRAFTER}` "
            f"(`--spec-type {s.llamacpp_spec} --spec-draft-n-max {s.drafts}`); `THREADS`, `HOST` and `PORT` "
            "in the environment set `-t`, `--host` and `--port` (defaults: all cores, 127.0.0.1, 8080)."]


def _convention_lines(cfg: DrafterConfig, s: LaunchSettings) -> list[str]:
    """The block convention, stated: which block outputs are drafts decides how an engine must run it."""
    if cfg.anchor_predicts:
        return [f"Block convention: DeepSpec's. The block is [anchor, mask x {s.block_size - 1}] and every block "
                f"position i drafts the token at anchor+i+1, so one block gives {s.drafts} drafts (vLLM "
                f"`num_speculative_tokens` {s.drafts}, llama.cpp `--spec-draft-n-max` {s.drafts}); the Markov "
                "head's first predecessor is the anchor. A z-lab DFlash reader (drafts from positions 1.., the "
                "token at anchor+i) would draft one position off, so the drafter is written for DSpark readers "
                "only (`Qwen3DSparkModel`, `dflash.sample_from_anchor` true).", ""]
    if cfg.is_dspark:
        return [f"Block convention: z-lab's. The block is [anchor, mask x {s.block_size - 1}] and block positions "
                f"1..{s.block_size - 1} draft the token at their own position ({s.drafts} drafts); the Markov head's "
                "first predecessor is the anchor (`dflash.sample_from_anchor` false).", ""]
    return []


def _readme(engines: list[str], s: LaunchSettings, dtype: str, vocab: int | None, sources: dict,
            cfg: DrafterConfig) -> str:
    precision = s.precision or dtype
    hf = any(e in HF_ENGINES for e in engines)
    lines = [f"# Serving bundle: {s.name}", "",
             f"Target `{s.name}` ({precision}, from `{sources['target']}`) with the {drafter_kind(cfg)} drafter "
             f"`{sources['drafter']}` "
             f"(block size {s.block_size}, {s.drafts} drafts per block, taps {s.target_layer_ids}, mask token "
             f"{s.mask_token_id}), "
             f"tensor parallel size {s.tp}, up to {s.max_batch_size} requests at once of up to "
             f"{s.max_context} tokens each (prompt + output). Every engine serves it as `{s.name}`.", "",
             *_convention_lines(cfg, s), "## Launch", ""]
    for e in engines:
        lines.append(f"- {ENGINE_NAMES[e]}: `sh {e}/launch.sh [extra engine flags]`")
    if "trtllm" in engines:
        lines += ["", "`trtllm/extra_llm_api_options.yaml` holds `tensor_parallel_size`, `max_batch_size`, "
                  "`max_seq_len`, `max_num_tokens`, the `speculative_config` (DFlash) and `cuda_graph_config`; "
                  "trtllm-serve reads it with `--extra_llm_api_options` (alias `--config`) and lets it override "
                  "its own flags, so change those values in the YAML, not with `--tp_size` and the like. "
                  "`--served-model-name` needs a trtllm-serve that has it (TensorRT-LLM pull request 11711); on "
                  "an older one remove that line and the model is named after its directory (`target`)."]
    if "llamacpp" in engines:
        lines += _llamacpp_readme_lines(s)
    lines += ["", "Every launch script changes into the bundle root first: the paths below are relative to it.",
              "", "## What each engine uses", ""]
    if hf and cfg.anchor_predicts:
        lines.append("- `drafter/`: DeepSpec's DSpark format (`config.json` with `architectures: [\"Qwen3DSparkModel\"]`, "
                     "`block_size`, `mask_token_id`, `target_layer_ids`, `markov_rank`, `markov_head_type`, "
                     "`enable_confidence_head`, `confidence_head_with_markov` at the top level, mask and taps also in "
                     "`dflash_config`; `model.safetensors` under DeepSpec's key names `markov_head.markov_w1/w2`, "
                     "`confidence_head.proj`, without the `embed_tokens` / `lm_head` copies: vLLM shares the "
                     "target's), read by vLLM (`method: dspark`).")
    elif hf:
        lines.append("- `drafter/`: z-lab DFlash format (`config.json` with `dflash_config.mask_token_id` and "
                     "`target_layer_ids`, `model.safetensors`), read by TensorRT-LLM, vLLM and SGLang.")
    if "llamacpp" in engines:
        heads = (" with its Markov head (`markov_w1`, `markov_w2`)" + (" and confidence head (`conf_proj`)"
                                                                        if cfg.confidence_head else "")
                 if cfg.markov_rank else "")
        lines.append(f"- `{LLAMACPP_DRAFTER}`: the drafter as a llama.cpp `dflash` GGUF{heads} (f32, the target's "
                     f"tokenizer), for `{LLAMACPP_TARGET}`.")
    lines += [*_draft_vocab_lines(engines, vocab),
              "- DLoop (several draft stages per verification) runs only in loopspec's own runtime; the "
              "engines run one draft stage per verification."]
    if hf:
        lines.append("- `target/`: Hugging Face checkpoint" + (f", modelopt {s.precision.upper()}-quantized."
                                                                if s.precision else f" in {dtype}.")
                     + " Its config.json carries `rope_theta` beside `rope_parameters` for transformers-4 readers.")
    if s.precision == "nvfp4":
        lines.append("- NVFP4 kernels need a Blackwell GPU (compute capability >= 10.0); other GPUs refuse it.")
    lines += ["", "## Support matrix", "", support_matrix_markdown(), "",
              "`manifest.json` lists the sha256 of every file, the sources' hashes and the tool versions.", ""]
    return "\n".join(lines)


def _manifest(out: Path, engines: list[str], s: LaunchSettings, dtype: str, vocab: int | None,
              sources: dict, cfg: DrafterConfig) -> dict:
    import importlib.metadata as md

    import loopspec

    tools = {"loopspec": loopspec.__version__, "torch": torch.__version__}
    for package in ("transformers", "safetensors", "nvidia-modelopt", "gguf"):
        try:
            tools[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    files = {str(p.relative_to(out)): file_sha256(p) for p in sorted(out.rglob("*")) if p.is_file()}
    draft_vocab = draft_vocab_per_engine(engines, vocab)
    reasons = {e: FULL_VOCAB_REASONS[e] for e in engines if vocab and e in FULL_VOCAB_REASONS}
    return {"kind": "serving-bundle", "engines": engines, "served_model_name": s.name,
            "tensor_parallel_size": s.tp, "max_batch_size": s.max_batch_size, "max_context": s.max_context,
            "precision": s.precision or dtype, "block_size": s.block_size, "mask_token_id": s.mask_token_id,
            "drafter_kind": drafter_kind(cfg), "block_convention": "deepspec" if cfg.anchor_predicts else "z-lab",
            "drafts_per_block": s.drafts,
            **({"vllm": {"method": s.vllm_method, "num_speculative_tokens": s.drafts}} if "vllm" in engines else {}),
            "target_layer_ids": s.target_layer_ids, "trained_draft_vocab_size": vocab, "draft_vocab": draft_vocab,
            "full_draft_vocab_reasons": reasons, "sources": sources, "tools": tools, "files": files,
            **({"llamacpp": {"target": LLAMACPP_TARGET, "drafter": LLAMACPP_DRAFTER, "drafter_dtype": "f32",
                             "spec_type": s.llamacpp_spec, "draft_max": s.drafts}} if "llamacpp" in engines else {})}


def build_bundle(target: str, drafter: str, out_dir: str | Path, engines: str | list[str], *,
                 precision: str | None = None, tp: int = 1, dtype: str = "bfloat16",
                 mask_token_id: int | None = None, max_batch_size: int = 8, max_context: int | None = None,
                 calib_prompts: str | None = None, calib_size: int | None = None,
                 threads: int | None = None) -> dict:
    """Write a serving bundle for `engines` into `out_dir`; returns its manifest. `threads` is the
    llama.cpp launch's default -t (None: all cores)."""
    target_gguf = _gguf_target(target)
    every = engines == "all" or engines == ["all"]
    engines = parse_engines(engines, gguf_target=target_gguf is not None)
    hf_engines = [e for e in engines if e in HF_ENGINES]
    if precision is not None and precision not in PRECISIONS:
        raise LoopspecError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    if dtype not in DTYPES:
        raise LoopspecError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if max_batch_size < 1:
        raise LoopspecError(f"max batch size must be >= 1, got {max_batch_size}")
    if "llamacpp" in engines and target_gguf is None:
        raise LoopspecError(LLAMACPP_NEEDS_GGUF.format(target=target))
    if not hf_engines and (tp != 1 or precision is not None):
        raise LoopspecError(HF_ONLY_OPTIONS)
    if threads is not None and threads < 1:
        raise LoopspecError(f"threads must be >= 1, got {threads}")
    out = check_out_dir(out_dir, "manifest.json", "a bundle")

    drafter_dir = _resolve_drafter(drafter, target)
    model = Drafter.load(drafter_dir)
    cfg = model.cfg
    engines = engines_for(cfg, engines, every)  # a DSpark drafter goes only where its heads run
    hf_engines = [e for e in engines if e in HF_ENGINES]
    if not hf_engines and (tp != 1 or precision is not None):
        raise LoopspecError(HF_ONLY_OPTIONS)
    if hf_engines:
        target_dir = resolve_target_dir(target)
        target_cfg = TargetConfig.from_hf(read_json(target_dir / "config.json", "target config"))
        positions, vocab_size = target_cfg.max_position_embeddings, target_cfg.vocab_size
    else:  # llama.cpp alone reads nothing but the GGUF
        info = gguf_target_info(target_gguf)
        positions, vocab_size = info["context_length"] or DEFAULT_MAX_CONTEXT, info["vocab_size"]
    max_context = resolve_max_context(max_context, positions)
    if cfg.mask_token_id is None:
        if mask_token_id is None and str(target) == "default":
            mask_token_id = DEFAULT_TARGET_MASK_TOKEN_ID
        # a GGUF's tokenizer names every row of its vocabulary: no unused row to take
        tokenizer_len = len(load_tokenizer(target_dir)) if hf_engines else vocab_size
        cfg.mask_token_id = resolve_mask_token_id(mask_token_id, tokenizer_len, vocab_size)
    if hf_engines:
        check_fits(cfg, target_cfg)
        check_tp(tp, target_cfg.num_heads, target_cfg.num_kv_heads, "target")
        check_tp(tp, cfg.num_heads, cfg.num_kv_heads, "drafter")

    draft_ids = model.draft_ids  # the reduced draft vocabulary (d2t), None when the drafter has none
    vocab = None if draft_ids is None else int(draft_ids.numel())
    with_vllm_drafter = vocab is not None and "vllm" in engines
    if str(target) == "default":
        name = DEFAULT_TARGET_NAME
    else:
        name = target_dir.name if hf_engines else target_gguf.stem
    s = LaunchSettings(name=name, tp=tp, block_size=cfg.block_size, drafts=cfg.drafts_per_block(cfg.block_size),
                       mask_token_id=cfg.mask_token_id,
                       target_layer_ids=list(cfg.target_layer_ids), precision=precision,
                       max_batch_size=max_batch_size, max_context=max_context,
                       vllm_drafter=f"./{VLLM_DRAFTER}" if with_vllm_drafter else "./drafter",
                       llamacpp_threads=threads, vllm_method="dspark" if cfg.anchor_predicts else "dflash",
                       llamacpp_spec=spec_type(cfg))
    fingerprint = target_fingerprint(target_dir) if hf_engines else file_sha256(target_gguf, limit_bytes=16 << 20)
    sources = {"target": str(target), "target_fingerprint": fingerprint,
               "drafter": str(drafter_dir),
               "drafter_files": {p.name: file_sha256(p) for p in sorted(drafter_dir.glob("*")) if p.is_file()}}
    if target_gguf is not None:
        sources["target_gguf"] = str(target_gguf)

    with staged_dir(out) as tmp:
        if "llamacpp" in engines:  # first: it keeps the reduced draft vocabulary the z-lab drafter/ drops
            (tmp / "llamacpp").mkdir()
            shutil.copyfile(target_gguf, tmp / LLAMACPP_TARGET)
            shutil.copyfile(cached_drafter_gguf(model, drafter_dir, target_gguf), tmp / LLAMACPP_DRAFTER)
        if hf_engines:
            _write_hf_parts(model, draft_ids, target_dir, target_cfg, tmp, dtype, precision, with_vllm_drafter,
                            calib_prompts, calib_size)
        for engine in engines:
            for rel, text in LAUNCH_FILES[engine](s).items():
                path = tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                if path.suffix == ".sh":
                    path.chmod(0o755)
        # a llama.cpp-only bundle serves the target GGUF in its own quantization
        label = dtype if hf_engines else "gguf"
        (tmp / "README.md").write_text(_readme(engines, s, label, vocab, sources, cfg))
        manifest = _manifest(tmp, engines, s, label, vocab, sources, cfg)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_hf_parts(model: Drafter, draft_ids, target_dir: Path, target_cfg: TargetConfig, tmp: Path, dtype: str,
                    precision: str | None, with_vllm_drafter: bool, calib_prompts: str | None,
                    calib_size: int | None) -> None:
    """drafter/ (z-lab, full vocabulary), vllm/drafter/ when asked for, and target/ (HF, maybe quantized)."""
    cfg = model.cfg
    # drafter/ drafts over the full vocabulary: no d2t file, no draft-vocabulary size in its config
    cfg.extra = {k: v for k, v in cfg.extra.items() if k != "draft_vocab_size"}
    model.draft_ids = None
    model.save(tmp / "drafter", dtype=DTYPES[dtype])
    if with_vllm_drafter:
        lm_head = target_lm_head(target_dir, target_cfg.tie_word_embeddings)
        write_vllm_drafter(model, draft_ids, lm_head, tmp / VLLM_DRAFTER, DTYPES[dtype])
    if precision is None:
        export_target(target_dir, tmp / "target", DTYPES[dtype])
    else:
        quantize_target(target_dir, tmp / "target", precision, calib_prompts, calib_size)
