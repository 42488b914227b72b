"""A ready pair: tokenizer + target + optional drafter + an engine, resolved from user arguments."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from loopspec.decoding import SamplingParams
from loopspec.defaults import (DEFAULT_BLOCK_SIZE, DEFAULT_DRAFTER_DIR, DEFAULT_DRAFTER_LAYERS,
                               DEFAULT_TARGET_MASK_TOKEN_ID)
from loopspec.errors import LoopspecError
from loopspec.model.drafter import Drafter, DrafterConfig, check_fits, resolve_mask_token_id
from loopspec.model.target import Target
from loopspec.weights import load_target_dir, load_tokenizer, resolve_target_dir
from loopspec.runtime.loop import AdaptiveFallback, GenerationResult, generate
from loopspec.runtime.torch_engine import TorchEngine

METHODS = ("ar", "dflash", "dloop")
BACKENDS = ("torch", "onnxruntime", "tensorrt")
DLOOP_DEFAULTS = {"gate_threshold": -0.5, "max_stages": 4}


def fresh_drafter(target: Target, tokenizer_len: int | None, is_default_target: bool, seed: int = 0,
                  mask_token_id: int | None = None) -> Drafter:
    """An untrained drafter shaped for `target` (lossless, but it rarely guesses right)."""
    if mask_token_id is None and is_default_target:
        mask_token_id = DEFAULT_TARGET_MASK_TOKEN_ID
    mask = resolve_mask_token_id(mask_token_id, tokenizer_len, target.cfg.vocab_size)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=DEFAULT_DRAFTER_LAYERS, block_size=DEFAULT_BLOCK_SIZE,
                                   mask_token_id=mask)
    torch.manual_seed(seed)
    drafter = Drafter(cfg)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)
    return drafter.eval()


def resolve_device(name: str) -> torch.device:
    """'cpu' or 'cuda' (optionally 'cuda:N'), refused clearly when torch cannot use it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LoopspecError(f"unknown device {name!r} (use cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise LoopspecError(f"unsupported device {name!r} (use cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LoopspecError(f"device {name!r} needs a CUDA GPU, and torch sees none (this torch: {torch.__version__})")
    return device


@dataclass
class Pipeline:
    tokenizer: object
    target_dir: Path
    drafter_dir: Path | None  # where the drafter was loaded from (None: none or fresh)
    target: Target | None  # None when the engines run from an exported --onnx-dir (no torch weights)
    drafter: Drafter | None
    engine: TorchEngine  # or an engine of the same interface (OrtEngine)
    drafter_description: str  # "shipped", "untrained (fresh random init)" or a path
    stop_token_ids: frozenset[int]

    @property
    def backend(self) -> str:
        return self.engine.backend

    def on_backend(self, backend: str, max_context: int | None = None, num_threads: int | None = None) -> "Pipeline":
        """The same pair (tokenizer, weights, drafter) on another backend's engine: torch, or
        onnxruntime over the pair's cached export. Used to compare backends in one process."""
        if backend == self.backend:
            return self
        if self.target is None or backend not in ("torch", "onnxruntime"):
            raise LoopspecError(f"cannot run this pipeline on backend {backend!r} as well: comparing backends needs "
                                "the target's weights and one of torch, onnxruntime")
        max_context = max_context or self.engine.max_context
        if backend == "onnxruntime":
            engine = cached_ort_engine(self.target, self.drafter, self.target_dir, self.drafter_dir, max_context,
                                       num_threads)
        else:
            engine = TorchEngine(self.target, self.drafter, max_context, num_threads)
        return dataclasses.replace(self, engine=engine)

    @property
    def default_block_size(self) -> int:
        return self.engine.drafter_cfg.block_size if self.engine.has_drafter else 1

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if not prompt or not prompt.strip():
            raise LoopspecError("empty prompt")
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.stop_token_ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def block_size_for(self, method: str, block_size: int | None) -> int:
        check_method(method, self.engine.has_drafter)
        if block_size is not None and block_size < 1:
            raise LoopspecError(f"block size must be >= 1, got {block_size}")
        if method == "ar":
            return 1
        if block_size is None and method == "dloop":
            block_size = self.tuned_dloop().get("block_size")
        return block_size or self.default_block_size

    def tuned_dloop(self) -> dict:
        """The setting `loopspec tune` stored with the drafter (config.json loopspec.dloop), if any."""
        return dict(self.engine.drafter_cfg.extra.get("dloop") or {}) if self.engine.has_drafter else {}

    def dloop_settings(self, gate_threshold: float | None = None, max_stages: int | None = None) -> dict:
        """DLoop's gate threshold and stage limit: given, else stored with the drafter, else defaults."""
        stored = self.tuned_dloop()
        out = {**DLOOP_DEFAULTS, **{k: v for k, v in stored.items() if k in DLOOP_DEFAULTS}}
        if gate_threshold is not None:
            out["gate_threshold"] = gate_threshold
        if max_stages is not None:
            if max_stages < 1:
                raise LoopspecError(f"max stages must be >= 1, got {max_stages}")
            out["max_stages"] = max_stages
        return out

    def run(self, prompt_ids: list[int], *, method: str = "dflash", max_new_tokens: int = 128,
            params: SamplingParams = SamplingParams(), block_size: int | None = None, seed: int | None = None,
            gate_threshold: float | None = None, max_stages: int | None = None, adaptive: bool = True,
            on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """`adaptive`: decode plainly while drafting does not pay on this request (output unchanged)."""
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        loop = self.dloop_settings(gate_threshold, max_stages) if method == "dloop" else {"max_stages": 1}
        fallback = AdaptiveFallback() if adaptive and method != "ar" else None
        return generate(self.engine, prompt_ids, max_new_tokens=max_new_tokens, params=params,
                        block_size=self.block_size_for(method, block_size), stop_token_ids=self.stop_token_ids,
                        generator=generator, on_tokens=on_tokens, fallback=fallback, **loop)


def check_method(method: str, has_drafter: bool) -> None:
    """Refuse an unknown method, or a drafting one without a drafter (before anything slow is loaded)."""
    if method not in METHODS:
        raise LoopspecError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if method != "ar" and not has_drafter:
        raise LoopspecError(f"method {method!r} needs a drafter (got --drafter none)")


def resolve_backend(backend: str, device: str = "cpu", cuda_graphs: bool | None = None,
                    onnx_dir: str | Path | None = None, trt_dir: str | Path | None = None) -> str:
    """'auto' → design §7's default: the backend of the artifacts named (--trt-dir, --onnx-dir); PyTorch
    on a GPU or with CUDA graphs; ONNX Runtime on the CPU when its extra is installed, else PyTorch."""
    if backend != "auto":
        return backend
    if trt_dir is not None:
        return "tensorrt"
    if onnx_dir is not None:
        return "onnxruntime"
    if device != "cpu" or cuda_graphs:
        return "torch"
    import importlib.util

    exportable = all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx", "onnxscript"))
    return "onnxruntime" if exportable else "torch"


def load_pipeline(target: str = "default", drafter: str | None = "default", max_context: int | None = None,
                  mask_token_id: int | None = None, num_threads: int | None = None, device: str = "cpu",
                  cuda_graphs: bool | None = None, backend: str = "torch", onnx_dir: str | Path | None = None,
                  trt_dir: str | Path | None = None) -> Pipeline:
    """Resolve `target` ('default' | checkpoint dir | .gguf) and `drafter` ('default' | dir | 'none').

    device: where the torch engine runs ('cpu' or 'cuda'); cuda_graphs: replay captured forwards
    (default: on for CUDA, off for the CPU). backend 'onnxruntime': the exported engines in `onnx_dir`
    (target and drafter are then not read), or — without onnx_dir — the pair exported once into
    ~/.cache/loopspec/onnx/<key of target + drafter> and reused while its manifest matches.
    backend 'tensorrt': the plans in `trt_dir` (built by `loopspec convert trt`) on the GPU.
    backend 'auto' (the command line's default): see `resolve_backend`."""
    backend = resolve_backend(backend, device, cuda_graphs, onnx_dir, trt_dir)
    if backend not in BACKENDS:
        raise LoopspecError(f"unknown backend {backend!r} (choose from auto, {', '.join(BACKENDS)})")
    if backend != "onnxruntime" and onnx_dir is not None:
        raise LoopspecError("--onnx-dir needs --backend onnxruntime")
    if backend == "onnxruntime" and (device != "cpu" or cuda_graphs):
        raise LoopspecError("the onnxruntime backend runs on the CPU here (use --device cpu, no CUDA graphs)")
    if (backend == "tensorrt") != (trt_dir is not None):
        raise LoopspecError("--backend tensorrt runs the plans of --trt-dir DIR (built by `loopspec convert trt`), "
                            "and --trt-dir needs --backend tensorrt")
    if onnx_dir is not None:
        return onnx_dir_pipeline(Path(onnx_dir), max_context, num_threads)
    if trt_dir is not None:
        return trt_dir_pipeline(Path(trt_dir), max_context)
    device = resolve_device(device)
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda"
    if cuda_graphs:
        from loopspec.runtime.cuda_graphs import require_cuda

        require_cuda(device)  # before any model is loaded
    is_default = str(target) == "default"
    target_dir = resolve_target_dir(target)
    tokenizer = load_tokenizer(target_dir)
    model = load_target_dir(target_dir)
    drafter_dir = None  # where the drafter was loaded from (tune stores its setting there)
    if drafter in (None, "none"):
        draft_model, description = None, "none"
    elif drafter == "default" and is_default and DEFAULT_DRAFTER_DIR.is_dir():
        drafter_dir = DEFAULT_DRAFTER_DIR
        draft_model, description = Drafter.load(drafter_dir), f"shipped ({drafter_dir.name})"
    elif drafter == "default":
        draft_model = fresh_drafter(model, len(tokenizer), is_default, mask_token_id=mask_token_id)
        description = "untrained (fresh random init: lossless but few drafts accepted)"
    else:
        drafter_dir = Path(drafter)
        draft_model, description = Drafter.load(drafter_dir), str(drafter)
        if draft_model.cfg.mask_token_id is None:
            draft_model.cfg.mask_token_id = resolve_mask_token_id(mask_token_id, len(tokenizer), model.cfg.vocab_size)
    if draft_model is not None:
        check_fits(draft_model.cfg, model.cfg)
    stop = set(model.cfg.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(tokenizer.eos_token_id)
    if device.type != "cpu":
        model = model.to(device)
        draft_model = draft_model.to(device) if draft_model is not None else None
    if backend == "onnxruntime":
        engine = cached_ort_engine(model, draft_model, target_dir, drafter_dir, max_context, num_threads)
    else:
        engine = TorchEngine(model, draft_model, max_context or model.cfg.max_position_embeddings, num_threads,
                             cuda_graphs=cuda_graphs)
    return Pipeline(tokenizer=tokenizer, target_dir=target_dir, drafter_dir=drafter_dir, target=model,
                    drafter=draft_model, engine=engine,
                    drafter_description=description, stop_token_ids=frozenset(stop))


def onnx_dir_pipeline(onnx_dir: Path, max_context: int | None, num_threads: int | None) -> Pipeline:
    """A pipeline over an exported directory alone: its engines, its tokenizer and configs."""
    from loopspec.runtime.ort_engine import OrtEngine

    return artifact_pipeline(OrtEngine(onnx_dir, max_context, num_threads), onnx_dir)


def artifact_pipeline(engine, directory: Path) -> Pipeline:
    """The pipeline around an engine that runs from an artifact directory (its tokenizer and configs)."""
    tokenizer = load_tokenizer(directory / "target")
    stop = set(engine.target_cfg.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(tokenizer.eos_token_id)
    description = f"exported ({directory})" if engine.has_drafter else "none"
    return Pipeline(tokenizer=tokenizer, target_dir=directory / "target", drafter_dir=None, target=None, drafter=None,
                    engine=engine, drafter_description=description, stop_token_ids=frozenset(stop))


def trt_dir_pipeline(plan_dir: Path, max_context: int | None) -> Pipeline:
    """A pipeline over TensorRT plans alone: their engines, tokenizer and configs."""
    from loopspec.runtime.trt_engine import TrtEngine

    return artifact_pipeline(TrtEngine(plan_dir, max_context), plan_dir)


def cached_ort_engine(model: Target, draft_model: Drafter | None, target_dir: Path, drafter_dir: Path | None,
                      max_context: int | None, num_threads: int | None):
    """OrtEngine over the pair's export in the cache, exported on first use (and again when the
    cached files no longer match their manifest)."""
    import sys

    from loopspec.engines.export import OPSET, export_engines, source_key
    from loopspec.runtime.ort_engine import OrtEngine
    from loopspec.weights import cache_root

    onnx_dir = cache_root() / "onnx" / source_key(target_dir, draft_model, drafter_dir, {"opset": OPSET})
    if (onnx_dir / "manifest.json").is_file():
        try:
            return OrtEngine(onnx_dir, max_context, num_threads)
        except LoopspecError as e:
            print(f"[loopspec] cached ONNX engines unusable ({e}); exporting again", file=sys.stderr)
    print(f"[loopspec] exporting ONNX engines to {onnx_dir} (once)", file=sys.stderr)
    export_engines(model, draft_model, onnx_dir, target_dir=target_dir, drafter_dir=drafter_dir)
    return OrtEngine(onnx_dir, max_context, num_threads)
