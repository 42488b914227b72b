"""llama.cpp interoperability: a DFlash drafter as a llama.cpp `dflash` GGUF, and the one llama-server
command line that serves a GGUF target with it (the bundle and the benchmark both build it here).

Format facts this module relies on (llama.cpp as vendored by llama-cpp-python 0.3.36: its DFlash
converter, the `dflash` model loader and common/speculative.cpp; re-check on upgrades):
- general.architecture "dflash"; the Qwen3-style hyperparameters under `dflash.` (block_count,
  context_length, embedding_length, feed_forward_length, attention.head_count / head_count_kv /
  key_length / value_length, rope.freq_base, attention.layer_norm_rms_epsilon), `dflash.block_size`
  and `dflash.target_layers`: the HF hidden_states indices of the taps (target_layer_ids + 1). The
  loader refuses a file without target_layers.
- The tokenizer is the target's: llama-server refuses to speculate when the draft's vocabulary does
  not match the target's, so every `tokenizer.*` key of the target GGUF is copied; the mask token is
  `tokenizer.ggml.mask_token_id`.
- Tensors in HF Qwen3 order (dflash ropes NeoX style, so q/k rows are not permuted): per layer
  attn_norm, attn_q/k/v, attn_output, attn_q_norm/attn_k_norm, ffn_norm, ffn_gate/up/down; `fc`,
  `enc.output_norm` (hidden_norm), `output_norm` (final norm). No token_embd: the draft takes the
  target's embedding. A reduced draft vocabulary is the I64 tensor `d2t` of ABSOLUTE target ids plus
  the draft's own head `output` (the target's lm_head rows of those ids); a full-vocabulary draft
  leaves both out and shares the target's output head.
- llama-server: `-m TARGET -md DRAFT --spec-type draft-dflash --spec-draft-n-max N`, N <= block_size - 1.
- EAGLE-3 drafters are llama.cpp's `eagle3` architecture, written by its own convert_hf_to_gguf.py
  (conversion/llama.py: a one-layer config with `draft_vocab_size`, `--target-model-dir` for the
  target's config.json and tokenizer; the top-level `eagle_aux_hidden_state_layer_ids` become its
  `extract_layers`, the inputs of those target layers: common/speculative.cpp) and served with
  `--spec-type draft-eagle3`; loopspec does not write that GGUF itself (convert/bundles/llamacpp.py).

DSpark drafters are the same `dflash` architecture plus the Markov head (that version has no `dspark`
architecture; its DSpark converter, conversion/qwen.py `DSparkModel`, also writes `dflash`):
- tensors `markov_w1.weight` and `markov_w2.weight` ([V, r] in PyTorch's layout, i.e. ggml {r, V};
  with a reduced draft vocabulary markov_w2 holds the draft rows only, {r, Vd}), and optionally
  `conf_proj.weight` ([1, H + r], the confidence head over [h ; W1[prev]]) and `conf_proj.bias` [1].
  The rank is read from markov_w1's shape: there is no rank key. llama-server chooses `draft-dspark`
  when markov_w1 is present (common/speculative.cpp).
- bool keys `dflash.sample_from_anchor` (true: every block position drafts, DeepSpec's convention, up
  to block_size drafts; false: position 0 is the bonus anchor and positions 1.. draft, up to
  block_size - 1) and `dflash.has_confidence_head`.
- Only the vanilla Markov head exists there (the graph is `bias = W2 · W1[prev]`, and the converter
  refuses other head types), and the confidence head reads [h ; W1[prev]] only (its shape is fixed at
  n_embd + r).
- Newer llama.cpp (ggml-org master, src/models/dspark.cpp) has a separate `dspark` architecture with
  the same tensor names and a required `dspark.markov_rank` key; this module writes what the pinned
  version above reads, as the bundle's llama-server is built from it (scripts/build_llama_server.sh).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from loopspec.errors import LoopspecError
from loopspec.files import cache_root, file_sha256
from loopspec.model.drafter_kinds import DEEPSPEC_BLOCK

ARCH = "dflash"
DTYPES = ("f32", "f16")
MASK_KEY = "tokenizer.ggml.mask_token_id"
LLAMA_SERVER = "llama-server"
SPEC_TYPES = {False: "draft-dflash", True: "draft-dspark"}  # by: the drafter has a Markov head
EAGLE3_SPEC = "draft-eagle3"  # an EAGLE-3 drafter, from llama.cpp's own converter (its eagle3 architecture)


def spec_type(cfg) -> str:
    """llama-server's --spec-type for a drafter: draft-eagle3 for an EAGLE-3 drafter, draft-dspark runs
    the Markov head, draft-dflash not."""
    if cfg.kind.chain:
        return EAGLE3_SPEC
    return SPEC_TYPES[cfg.kind.markov is not None]


# --------------------------------------------------------------------------------------------------
# the target GGUF: what the drafter must fit, and what the draft file takes from it


def _open_gguf(path: Path, what: str):
    from gguf import GGUFReader

    if not path.is_file():
        raise LoopspecError(f"{what} GGUF file does not exist: {path}")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError / struct errors on garbage
        raise LoopspecError(f"cannot read {what} GGUF file {path}: {e}") from None


def _field_value(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _target_shape(reader, path: Path) -> dict:
    """The target's architecture, hidden size, layer count, vocabulary size and trained context, from
    its metadata."""
    arch = _field_value(reader, "general.architecture")
    hidden = _field_value(reader, f"{arch}.embedding_length")
    layers = _field_value(reader, f"{arch}.block_count")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if arch is None or hidden is None or layers is None or tokens is None:
        raise LoopspecError(
            f"{path.name} lacks the architecture, embedding length, block count or tokenizer "
            "metadata of a llama.cpp model"
        )
    context = _field_value(reader, f"{arch}.context_length")
    return {
        "arch": arch,
        "hidden_size": int(hidden),
        "num_layers": int(layers),
        "vocab_size": len(tokens.data),
        "context_length": None if context is None else int(context),
    }


def gguf_target_info(target_gguf: str | Path) -> dict:
    """{arch, hidden_size, num_layers, vocab_size, context_length} of a target GGUF."""
    path = Path(target_gguf)
    return _target_shape(_open_gguf(path, "target"), path)


def _target_head_rows(reader, path: Path, rows: np.ndarray | None, hidden: int) -> np.ndarray:
    """The target's output projection (its token embedding when tied) at `rows` → float32 [len, H],
    dequantized as gguf's own reader dequantizes, row by row so only those rows are expanded."""
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if head is None:
        raise LoopspecError(f"{path.name} has neither output.weight nor token_embd.weight")
    data = np.asarray(head.data)
    if rows is not None:
        data = data[rows]
    return dequantize(data, head.tensor_type).astype(np.float32).reshape(-1, hidden)


def _check_fits(cfg, shape: dict, path: Path) -> None:
    """Refuse a drafter the target GGUF cannot drive, naming every mismatch."""
    problems = []
    if cfg.hidden_size != shape["hidden_size"]:
        problems.append(f"hidden size {cfg.hidden_size} != target's {shape['hidden_size']}")
    if cfg.vocab_size != shape["vocab_size"]:
        problems.append(f"vocab size {cfg.vocab_size} != target's {shape['vocab_size']}")
    if cfg.num_target_layers != shape["num_layers"]:
        problems.append(
            f"drafter was built for {cfg.num_target_layers} target layers, target has {shape['num_layers']}"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < shape["num_layers"]]
    if bad:
        problems.append(f"tap ids {bad} out of range for a target with {shape['num_layers']} layers")
    if cfg.mask_token_id is None:
        problems.append("no mask token id (set dflash_config.mask_token_id)")
    elif not 0 <= cfg.mask_token_id < shape["vocab_size"]:
        problems.append(f"mask token id {cfg.mask_token_id} outside the vocabulary of {shape['vocab_size']}")
    if cfg.rope_scaling is not None:
        problems.append(f"rope scaling {cfg.rope_scaling} is not written to llama.cpp GGUFs here")
    if problems:
        raise LoopspecError(f"drafter does not fit the target {path.name}: " + "; ".join(problems))


def _copy_tokenizer(reader, writer) -> list[str]:
    """Every tokenizer.* key of the target, as typed there (the mask token is the drafter's)."""
    from gguf import GGUFValueType

    copied = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name == MASK_KEY:
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
        copied.append(name)
    return copied


# --------------------------------------------------------------------------------------------------
# the drafter GGUF


# DeepSpec's head tensors → llama.cpp's names (conversion/qwen.py's tensor map)
HEAD_TENSORS = {
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}


def _draft_tensors(drafter) -> dict[str, np.ndarray]:
    """The drafter's weights under llama.cpp's dflash names, float32 numpy in PyTorch [out, in] layout
    (which gguf stores reversed, as ggml's {in, out}); a Markov W2 of the draft rows only when the
    drafter has a reduced draft vocabulary."""
    state = {k: v.detach().float().cpu().numpy() for k, v in drafter.zlab_state_dict().items()}
    heads = {HEAD_TENSORS[k]: state.pop(k) for k in list(state) if k in HEAD_TENSORS}
    if "markov_w2.weight" in heads and drafter.draft_ids is not None:
        heads["markov_w2.weight"] = heads["markov_w2.weight"][drafter.draft_ids.long().cpu().numpy()]
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"fc": "fc", "hidden_norm": "enc.output_norm", "norm": "output_norm"}
    out = {}
    for name, w in state.items():
        base = name.removesuffix(".weight")
        if base.startswith("layers."):
            _, i, rest = base.split(".", 2)
            out[f"blk.{i}.{per_layer[rest]}.weight"] = w
        else:
            out[f"{top[base]}.weight"] = w
    return out | heads


def _write_hparams(writer, cfg, name: str, file_type: int) -> None:
    p = f"{ARCH}."
    writer.add_string("general.name", name)
    writer.add_uint32("general.file_type", file_type)
    writer.add_uint32(p + "block_count", cfg.num_layers)
    writer.add_uint32(p + "context_length", cfg.max_position_embeddings)
    writer.add_uint32(p + "embedding_length", cfg.hidden_size)
    writer.add_uint32(p + "feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(p + "attention.head_count", cfg.num_heads)
    writer.add_uint32(p + "attention.head_count_kv", cfg.num_kv_heads)
    writer.add_uint32(p + "attention.key_length", cfg.head_dim)
    writer.add_uint32(p + "attention.value_length", cfg.head_dim)
    writer.add_float32(p + "rope.freq_base", float(cfg.rope_theta))
    writer.add_float32(p + "attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    writer.add_uint32(p + "block_size", cfg.block_size)
    # llama.cpp taps HF hidden_states indices: the output of layer i is hidden_states[i + 1]
    writer.add_array(p + "target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
    writer.add_uint32(MASK_KEY, int(cfg.mask_token_id))
    kind = cfg.kind
    if kind.markov is not None:  # read by draft-dspark only
        writer.add_bool(p + "sample_from_anchor", kind.convention.first_draft == 0)
        writer.add_bool(p + "has_confidence_head", kind.confidence is not None)


def dflash_gguf_refusal(kind) -> str | None:
    """Why a drafter of this kind cannot be the dflash GGUF written here (the facts above; None: it can): a
    block drafter of z-lab's convention, or of DeepSpec's with a Markov head (draft-dspark); the vanilla
    Markov head only; a confidence head only beside it, reading [h ; W1[prev]]. An EAGLE-3 or DFlash2
    drafter is llama.cpp's own converter's (convert/bundles/llamacpp.py says which llama.cpp takes)."""
    if kind.chain:  # llama.cpp runs it, from its own converter's eagle3 GGUF
        return (
            "an EAGLE-3 drafter is llama.cpp's eagle3 architecture (draft-eagle3), converted by llama.cpp's "
            "own convert_hf_to_gguf.py, not a dflash GGUF (loopspec convert bundle --framework llamacpp "
            "writes it for that converter)"
        )
    if kind.selector is not None:  # llama.cpp runs it, from its own converter's dflash GGUF with the selector
        return (
            "a DFlash2 drafter is llama.cpp's dflash architecture with its selector, converted by llama.cpp's "
            "own convert_hf_to_gguf.py, not by loopspec (loopspec convert bundle --framework llamacpp writes "
            "it for that converter)"
        )
    if not kind.heads:
        if kind.convention is DEEPSPEC_BLOCK:  # draft-dflash drafts from block position 1; only draft-dspark from 0
            return (
                "llama.cpp drafts from the anchor's own block position (DeepSpec's block convention) only "
                "with a Markov head (draft-dspark); this DeepSpec DFlash drafter has none"
            )
        return None
    if kind.markov is None:
        return "llama.cpp runs a DSpark confidence head only beside a Markov head (markov_rank > 0)"
    if kind.markov.head_type != "vanilla":
        return (
            f"llama.cpp's DSpark implements the vanilla Markov head only (bias = W2 · W1[prev]), not this "
            f"drafter's {kind.markov.head_type} head"
        )
    if kind.confidence and not kind.confidence.reads_markov:
        return (
            "llama.cpp's DSpark confidence head reads [h ; W1[prev]] (n_embd + rank inputs); this drafter's "
            "reads h alone (confidence_head_with_markov false)"
        )
    return None


def write_dflash_gguf(drafter, target_gguf: str | Path, out_path: str | Path, *, dtype: str = "f32") -> Path:
    """Write `drafter` (a loaded `Drafter`) as a llama.cpp dflash GGUF for the target `target_gguf`, a
    DSpark drafter with its Markov (and confidence) head. dtype f32 keeps the drafter's arithmetic;
    f16 halves the file (norms and biases stay f32, as llama.cpp keeps them). Written to a temporary
    sibling and renamed, so a failure leaves no file behind."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    problem = dflash_gguf_refusal(drafter.cfg.kind)
    if problem:
        raise LoopspecError(f"cannot write this drafter as a llama.cpp GGUF: {problem}")
    if dtype not in DTYPES:
        raise LoopspecError(f"unknown GGUF dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    target_gguf, out_path = Path(target_gguf), Path(out_path)
    if not out_path.parent.is_dir():
        raise LoopspecError(f"the directory of {out_path} does not exist")
    if out_path.is_dir():
        raise LoopspecError(f"{out_path} is a directory, not a GGUF file path")
    reader = _open_gguf(target_gguf, "target")
    shape = _target_shape(reader, target_gguf)
    cfg = drafter.cfg
    _check_fits(cfg, shape, target_gguf)

    tensors = _draft_tensors(drafter)
    if drafter.draft_ids is not None:
        ids = drafter.draft_ids.long().cpu().numpy()
        tensors["output.weight"] = _target_head_rows(reader, target_gguf, ids, shape["hidden_size"])
    float_type = GGMLQuantizationType.F16 if dtype == "f16" else GGMLQuantizationType.F32
    file_type = LlamaFileType.MOSTLY_F16 if dtype == "f16" else LlamaFileType.ALL_F32

    tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        writer = GGUFWriter(str(tmp), ARCH)
        # a refused kind never gets here: a Markov head is what makes it DSpark
        _write_hparams(writer, cfg, f"{target_gguf.stem} {cfg.kind.family} drafter", int(file_type))
        _copy_tokenizer(reader, writer)
        for name, w in tensors.items():
            # norms (1-D) stay f32: llama.cpp computes them in f32 and its own converter keeps them so
            cast = np.float16 if float_type == GGMLQuantizationType.F16 and w.ndim > 1 else np.float32
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=cast))
        if drafter.draft_ids is not None:
            writer.add_tensor("d2t", ids.astype(np.int64), raw_dtype=GGMLQuantizationType.I64)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out_path


def read_dflash_gguf(path: str | Path) -> dict:
    """A dflash GGUF's metadata {key: value} and tensors {name: (shape [out, in], type name)}, read back
    to check what was written."""
    path = Path(path)
    reader = _open_gguf(path, "drafter")
    keys = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    if keys.get("general.architecture") != ARCH:
        raise LoopspecError(
            f"{path.name} is not a DFlash drafter GGUF (architecture "
            f"{keys.get('general.architecture')!r}, expected {ARCH!r})"
        )
    # GGUF stores dims innermost first; reversed they read as PyTorch's [out, in]
    tensors = {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name) for t in reader.tensors}
    return {"keys": keys, "tensors": tensors}


# --------------------------------------------------------------------------------------------------
# llama-server


def llama_server_command(
    binary: str | Path,
    target_gguf: str | Path,
    *,
    drafter_gguf: str | Path | None = None,
    draft_max: int | None = None,
    threads: int | str | None = None,
    context: int | None = None,
    host: str = "127.0.0.1",
    port: int | str = 8080,
    slots: int | None = None,
    spec: str = SPEC_TYPES[False],
) -> list[str]:
    """llama-server's argv serving `target_gguf`, plain or with the drafter `drafter_gguf` (--spec-type
    `spec`: `spec_type(cfg)`) drafting up to `draft_max` tokens per step (llama.cpp caps it at the
    drafter's drafts per block: block_size - 1, or block_size for an anchor-drafting DSpark). `threads` and
    `port` may be shell variables ("$PORT") for a launch script; `slots`: how many requests it
    decodes at once (its -np; the context is shared among them)."""
    argv = [str(binary), "-m", str(target_gguf), "--host", host, "--port", str(port)]
    if threads is not None:
        argv += ["-t", str(threads)]
    if context is not None:
        argv += ["-c", str(context)]
    if slots is not None:
        argv += ["-np", str(slots)]
    if drafter_gguf is not None:
        if spec not in (*SPEC_TYPES.values(), EAGLE3_SPEC):
            raise LoopspecError(f"unknown llama.cpp speculative type {spec!r}")
        argv += ["-md", str(drafter_gguf), "--spec-type", spec]
        if draft_max is not None:
            argv += ["--spec-draft-n-max", str(draft_max)]
    elif draft_max is not None:
        raise LoopspecError("draft_max needs a drafter GGUF")
    return argv


def find_llama_server(path: str | Path | None = None) -> Path | None:
    """The llama-server binary: `path` when given (an executable file, or a bare name found on PATH),
    else `llama-server` on PATH, else None."""
    if path is not None:
        on_path = shutil.which(str(path)) if os.sep not in str(path) else None
        path = Path(on_path or path)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise LoopspecError(
                f"llama-server binary {path} does not exist or is not executable "
                "(scripts/build_llama_server.sh builds one)"
            )
        return path
    found = shutil.which(LLAMA_SERVER)
    return Path(found) if found else None


def cached_drafter_gguf(drafter, drafter_dir, target_gguf: Path) -> Path:
    """The drafter as a llama.cpp DFlash GGUF in ~/.cache/loopspec/llamacpp/<key>/drafter.gguf,
    written on first use (key: the drafter's config and weights, the target GGUF, the writer's code).
    bench's llama.cpp peer drafts with it and a bundle copies it."""
    h = hashlib.sha256(json.dumps(drafter.cfg.to_zlab(), sort_keys=True).encode())
    h.update(file_sha256(Path(__file__)).encode())
    h.update(str(Path(target_gguf).resolve()).encode())
    for p in sorted(Path(drafter_dir).glob("*.safetensors")) if drafter_dir is not None else []:
        h.update(file_sha256(p).encode())
    out = cache_root() / "llamacpp" / h.hexdigest()[:16] / "drafter.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_dflash_gguf(drafter, target_gguf, out)
    return out
