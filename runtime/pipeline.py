"""A ready pair on a backend: tokenizer + target + optional drafter + an Engine, resolved from user
arguments. Prompts are encoded (chat templating included) only here."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from loopspec.decoding import SamplingParams
from loopspec.errors import InvalidValue, LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.model.drafters import drafter_config
from loopspec.model.families import export_refusal
from loopspec.model.target import Target
from loopspec.pair import load_pair, stop_token_ids
from loopspec.precisions import REGISTRY, describe_precision, precision_names
from loopspec.prompts import chat_ids, prompt_ids
from loopspec.settings import DecodingSettings, engine_key, resolve_settings
from loopspec.tuned import user_setting
from loopspec.weights import TargetSource, load_tokenizer
from loopspec.runtime.budget import pacing
from loopspec.runtime.constraint import Constraint, Grammars, GrammarSpec
from loopspec.runtime.decoder import GenerationResult, generate
from loopspec.runtime.detokenize import Detokenizer
from loopspec.runtime.step_costs import StepCosts, stored_step_costs
from loopspec.engines.protocol import Engine
from loopspec.engines.backends import BACKENDS, artifact_engine, cached_onnx_engine, require_cuda, torch_engine
from loopspec.engines.target_step import step_refusal
from loopspec.gguf_blocks import read_gguf_target

# what a pair's target computes with on the torch and onnxruntime backends (loopspec/precisions.py);
# "auto" picks the fastest this backend has for this target (`resolve_precision`). Artifact
# directories may also hold modelopt-quantized engines (ARTIFACT_PRECISIONS).
PRECISIONS = ("auto",) + tuple(
    name
    for name in precision_names(weights=("fp32", "gguf"))
    if {"torch", "onnxruntime"} & set(REGISTRY[name].backends)
)
ARTIFACT_PRECISIONS = precision_names(weights=("modelopt",))


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
    target: Target | None  # None when the engines run from an exported directory (no torch weights)
    drafter: Drafter | None
    engine: Engine
    drafter_description: str  # "shipped (...)", "untrained (...)", a path, or "none"
    stop_token_ids: frozenset[int]
    target_source: TargetSource | None = None  # the target as resolved from its name (None: artifacts)
    tuned_store: Path | None = None  # where users' tune results for shipped drafters are (None: the cache's)
    step_costs_file: Path | None = None  # the step-cost table given for this engine (None: the stored one, if any)

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def engine_name(self) -> str:
        """Backend and precision, e.g. "onnxruntime gguf-int8act": what bench rows and the stats line name."""
        return f"{self.engine.backend} {self.engine.precision}"

    @property
    def tuning_key(self) -> str:
        """Where `loopspec tune` stores this engine's setting (loopspec.settings.engine_key)."""
        return engine_key(self.engine.backend, self.engine.precision)

    def describe_engine(self) -> str:
        return f"{self.engine_name} ({describe_precision(self.engine.precision, self.engine.block_types)})"

    def on_backend(
        self, backend: str, max_context: int | None = None, num_threads: int | None = None, precision: str = "auto"
    ) -> "Pipeline":
        """The same pair (tokenizer, weights, drafter) on another engine: torch, or onnxruntime over
        the pair's cached export in `precision`. Used to compare engines in one process."""
        if self.target is None or backend not in ("torch", "onnxruntime"):
            raise LoopspecError(
                f"cannot run this pipeline on backend {backend!r} as well: comparing engines needs "
                "the target's weights and one of torch, onnxruntime"
            )
        precision = resolve_precision(precision, backend, self.target_source)
        if (backend, precision) == (self.backend, self.engine.precision):
            return self
        max_context = max_context or self.engine.max_context
        if backend == "onnxruntime":
            engine = cached_ort_engine(
                self.target,
                self.drafter,
                self.target_dir,
                self.drafter_dir,
                max_context,
                num_threads,
                precision,
                self.target_source,
            )
        else:
            engine = torch_engine(self.target, self.drafter, max_context, num_threads)
        return dataclasses.replace(self, engine=engine, step_costs_file=None)  # a table is one engine's

    def with_rows(self, max_rows: int) -> "Pipeline":
        """The same pipeline over an engine with `max_rows` batch rows (the server's batch)."""
        if max_rows < 1:
            raise LoopspecError(f"max batch size must be >= 1, got {max_rows}")
        return dataclasses.replace(self, engine=self.engine.with_rows(max_rows))

    def settings(self, method: str, **knobs) -> DecodingSettings:
        """The decoding settings of `method` for this pipeline's drafter on its backend; `knobs` are
        those of loopspec.settings.resolve_settings (loopspec.settings.KNOBS: block_size,
        gate_threshold, max_stages, tree_budget, suffix, ...). A user's tune result for a shipped
        drafter wins over the setting shipped with it (loopspec/tuned.py)."""
        return resolve_settings(
            method,
            self.engine.drafter_cfg,
            engine=self.tuning_key,
            chains_only=self.engine.chains_only,
            tuned=self.user_tuned,
            **knobs,
        )

    @functools.cached_property
    def step_costs(self) -> StepCosts | None:
        """The step-cost table of this engine: the file given (refused if measured on another engine),
        else the one `loopspec costs` stored for it when measured on this CPU, else None."""
        if self.step_costs_file is not None:
            return StepCosts.load(self.step_costs_file, engine=self.engine_name)
        return stored_step_costs(self.engine_name)

    def pacing(self, settings: DecodingSettings):
        """What decides how much each step of `settings` verifies (runtime/budget.py `pacing`)."""
        return pacing(settings, self.engine, self.step_costs)

    def describe_pacing(self, settings: DecodingSettings) -> str:
        """Which pacing `settings` get here, for the stats line."""
        if self.step_costs is None:
            return "timing fallback (no step costs for this engine: `loopspec costs` measures them)"
        return f"verification budget (step costs: {self.step_costs_file or 'stored'})"

    @functools.cached_property
    def user_tuned(self) -> dict | None:
        """The user's stored tune result for this engine when the drafter is a shipped one (read
        once: `tune` resolves settings for every point of its grid)."""
        return user_setting(self.drafter_dir, self.tuning_key, self.tuned_store)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """A user prompt → token ids, wrapped in the chat template when `chat` and the model has one."""
        if not prompt or not prompt.strip():
            raise LoopspecError("empty prompt")
        return prompt_ids(self.tokenizer, prompt, chat)

    def encode_text(self, text: str) -> list[int]:
        """Plain text (no template) → token ids."""
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages ({role, content} with roles system/user/assistant; tool calls and results as
        runtime/tool_calls.py gives them) → the prompt of the model's chat template with the assistant's
        turn opened; `tools`: the functions the template shows the model."""
        return chat_ids(self.tokenizer, messages, tools)

    def decode(self, tokens: list[int]) -> str:
        """The text of `tokens` (stop tokens left out), ending at a whole character: the bytes of one
        the tokens have not finished are not text (runtime/detokenize.py)."""
        return self.detokenizer(tokens)

    @functools.cached_property
    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tokenizer, frozenset(self.stop_token_ids))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured output's compiler for this tokenizer (built once, on first use)."""
        return Grammars(self.tokenizer, self.engine.target_cfg.vocab_size, self.stop_token_ids)

    def constraint(self, grammar: GrammarSpec, prompt_ids: list[int] | None = None) -> Constraint:
        """A new row's grammar state for `grammar` (runtime/constraint.py), starting after the reply's
        reasoning where the model reasons first (`after_reasoning`)."""
        constraint = self.grammars.constraint(grammar)
        if prompt_ids is not None:
            self.after_reasoning(constraint, prompt_ids)
        return constraint

    def after_reasoning(self, constraint: Constraint, prompt_ids: list[int]) -> None:
        """Start `constraint` where the reply's reasoning ends, when a reply to `prompt_ids` opens with
        some: the chat template has a `<think>` block, `</think>` is one token, and the prompt does not
        already end with a closed block (Qwen3's template writes an empty one when thinking is off)."""
        end = self.reasoning_end_token
        if end is None:
            return
        tail = list(prompt_ids)
        while tail and not self.tokenizer.decode([tail[-1]]).strip():  # the blank lines after a block
            tail.pop()
        if not tail or tail[-1] != end:
            constraint.after_reasoning(end)

    @functools.cached_property
    def reasoning_end_token(self) -> int | None:
        """`</think>`'s id where the model reasons in a `<think>` block (its chat template says so)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if "<think>" not in str(template):
            return None
        ids = self.tokenizer.encode("</think>", add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def run(
        self,
        prompt_ids: list[int],
        settings: DecodingSettings,
        *,
        max_new_tokens: int = 128,
        params: SamplingParams = SamplingParams(),
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        grammar: GrammarSpec | None = None,
    ) -> GenerationResult:
        """Decode one prompt with `settings` (from `settings()`); `grammar`: structured output."""
        settings.check_sampling(params.greedy)
        return generate(
            self.engine,
            prompt_ids,
            settings,
            max_new_tokens=max_new_tokens,
            params=params,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            pacing=self.pacing(settings),
            on_tokens=on_tokens,
            constraint=None if grammar is None else self.constraint(grammar, prompt_ids),
        )


def resolve_backend(
    backend: str,
    device: str = "cpu",
    cuda_graphs: bool | None = None,
    onnx_dir: str | Path | None = None,
    trt_dir: str | Path | None = None,
) -> str:
    """'auto' → the default: the backend of the artifacts named (--trt-dir, --onnx-dir); PyTorch
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


def resolve_precision(precision: str, backend: str, target: "TargetSource | str | None") -> str:
    """'auto' → the fastest engine this backend builds for `target` (a TargetSource; a name is
    resolved): on ONNX Runtime, a GGUF target ('default' or a .gguf) runs its own blocks with int8
    activations in the fused step graph (gguf-fused, chains only; docs/benchmarks.md: its plain
    decoding 1.5-1.6x the exact-tree engine's, whose best method it passes), or where that graph does
    not build the target's layer in gguf-int8act; everything else fp32. An explicit gguf-* precision
    needs ONNX Runtime and a GGUF target."""
    if precision not in PRECISIONS:
        raise LoopspecError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    if precision == "fp32" or (precision == "auto" and backend != "onnxruntime"):
        return "fp32"
    if precision == "auto":
        try:
            gguf = TargetSource.of(target).gguf
        except LoopspecError:  # a target that cannot be read has no GGUF to read blocks from (its load says why)
            gguf = None
        if gguf is None:
            return "fp32"
        try:  # the fused step graph where it builds the file's layer (chains only); else the exact-tree one
            fused = step_refusal(read_gguf_target(gguf).config) is None
        except LoopspecError:  # a file the block engines do not build: loading it says why
            fused = False
        return "gguf-fused" if fused else "gguf-int8act"
    if backend != "onnxruntime":
        raise LoopspecError(f"precision {precision} runs on ONNX Runtime (--backend onnxruntime), not {backend}")
    TargetSource.of(target).require_gguf("the GGUF block precisions")  # a clear error for a target that is no GGUF
    return precision


def names_a_drafter(drafter: str | None, onnx_dir=None, trt_dir=None) -> bool:
    """Whether a drafter can come with these (known before anything is read; artifacts are checked
    when opened)."""
    return drafter not in (None, "none") or onnx_dir is not None or trt_dir is not None


@dataclass(frozen=True)
class EngineChoice:
    """Which engine runs the pair, as one value: the target and drafter ('default', a directory, a
    .gguf; drafter 'none'), the backend and what the target computes with, the device, the KV context,
    CPU threads and CUDA graphs — or the artifact directory (`onnx_dir`, `trt_dir`) to run instead.
    Built and checked once, from Python keywords or the command line's flags: a bad value or
    combination fails here, before anything loads; then load_pipeline, bench, tune and serve take it.
    backend 'auto' is resolved on construction (`resolve_backend`), and so is the target, into a
    TargetSource (a path that does not exist or is neither a checkpoint directory nor a .gguf fails
    here) — except with artifacts, which carry their own target (its name is then kept unread);
    precision 'auto' when the pipeline loads (it depends on the target file)."""

    target: TargetSource | str = "default"
    drafter: str | None = "default"
    backend: str = "auto"
    precision: str = "auto"
    device: str = "cpu"
    max_context: int | None = None
    threads: int | None = None
    cuda_graphs: bool | None = None
    onnx_dir: str | Path | None = None
    trt_dir: str | Path | None = None
    mask_token_id: int | None = None
    step_costs: str | Path | None = None  # a step-cost table for the verification budget (runtime/step_costs.py)

    def __post_init__(self):
        for name, value in (("max_context", self.max_context), ("num_threads", self.threads)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidValue(f"{name} must be a positive integer (or None for the default), got {value!r}")
        backend = resolve_backend(self.backend, self.device, self.cuda_graphs, self.onnx_dir, self.trt_dir)
        chosen = self.backend == "auto"
        object.__setattr__(self, "backend", backend)
        if backend not in BACKENDS:
            raise LoopspecError(f"unknown backend {backend!r} (choose from auto, {', '.join(BACKENDS)})")
        if backend != "onnxruntime" and self.onnx_dir is not None:
            raise LoopspecError("--onnx-dir needs --backend onnxruntime")
        if backend == "onnxruntime" and (self.device != "cpu" or self.cuda_graphs):
            raise LoopspecError("the onnxruntime backend runs on the CPU here (use --device cpu, no CUDA graphs)")
        if (backend == "tensorrt") != (self.trt_dir is not None):
            raise LoopspecError(
                "--backend tensorrt runs the plans of --trt-dir DIR (built by `loopspec convert trt`), "
                "and --trt-dir needs --backend tensorrt"
            )
        if self.precision not in PRECISIONS and not (self.from_artifacts and self.precision in ARTIFACT_PRECISIONS):
            raise LoopspecError(f"unknown precision {self.precision!r} (choose from {', '.join(PRECISIONS)})")
        if self.step_costs is not None:
            StepCosts.load(self.step_costs)  # a table that cannot be one is refused before anything loads
        if self.from_artifacts and self.mask_token_id is not None:
            raise LoopspecError(
                "--mask-token-id is for a drafter loaded from its checkpoint; an exported engine "
                "directory carries its mask token"
            )
        if not self.from_artifacts:
            object.__setattr__(self, "target", TargetSource.of(self.target))
            self._fit_backend_to_target(chosen)

    def _fit_backend_to_target(self, chosen: bool) -> None:
        """The exported engines build dense full-attention targets and every drafter kind: 'auto' picks
        PyTorch for the other target families (an explicit exported backend is refused in one line:
        loopspec.model.families) and for a drafter whose kind is not `exported_by_default` (EAGLE-3:
        its exported graphs, one call per drafted token, run with an explicit --backend onnxruntime)."""
        named = self.drafter not in (None, "none", "default")  # the shipped drafter is a DFlash drafter
        if chosen and named and not self._drafter_kind_exported_by_default():
            object.__setattr__(self, "backend", "torch")
            return
        cfg = self.target.config()
        refusal = None if cfg is None or self.backend == "torch" else export_refusal(cfg, self.backend)
        if refusal is None:
            return
        if chosen:  # 'auto' chose it: the family's backend instead
            object.__setattr__(self, "backend", "torch")
        else:
            raise LoopspecError(refusal)

    def _drafter_kind_exported_by_default(self) -> bool:
        try:
            return drafter_config(self.drafter).kind.exported_by_default
        except LoopspecError:  # loading the pair names what is wrong with the directory
            return True

    @property
    def from_artifacts(self) -> bool:
        return self.onnx_dir is not None or self.trt_dir is not None

    @property
    def names_a_drafter(self) -> bool:
        """Whether a drafter can come with it (known before anything loads; artifacts are checked when opened)."""
        return names_a_drafter(self.drafter, self.onnx_dir, self.trt_dir)

    @property
    def display_name(self) -> str:
        """The model's name for users (the served model id): the artifact directory's, else the target's."""
        if self.from_artifacts:
            return Path(self.onnx_dir if self.onnx_dir is not None else self.trt_dir).resolve().name
        return self.target.display_name


def load_pipeline(
    target: TargetSource | str = "default",
    drafter: str | None = "default",
    max_context: int | None = None,
    mask_token_id: int | None = None,
    num_threads: int | None = None,
    device: str = "cpu",
    cuda_graphs: bool | None = None,
    backend: str = "auto",
    onnx_dir: str | Path | None = None,
    trt_dir: str | Path | None = None,
    precision: str = "auto",
) -> Pipeline:
    """The pipeline of an `EngineChoice` given as keywords (`open_pipeline` takes the value).

    target: 'default' | checkpoint dir | .gguf; drafter: 'default' | dir | 'none'. device: where the
    torch engine runs ('cpu' or 'cuda'); cuda_graphs: replay captured forwards (default: on for CUDA,
    off for the CPU). backend 'onnxruntime': the exported engines in `onnx_dir` (target and drafter
    are then not read), or — without onnx_dir — the pair exported once into
    ~/.cache/loopspec/onnx/<key of target + drafter> and reused while its manifest matches.
    backend 'tensorrt': the plans in `trt_dir` (built by `loopspec convert trt`) on the GPU.
    backend 'auto' (the default, as on the command line): see `resolve_backend`. precision: what the
    target computes with (fp32, or on ONNX Runtime the GGUF's own blocks; 'auto': `resolve_precision`);
    artifacts in onnx_dir / trt_dir carry their own, which an explicit precision must name. The engine
    has one batch row; `Pipeline.with_rows` gives more. A max_context or num_threads that is not a
    positive integer raises InvalidValue (a ValueError)."""
    return open_pipeline(
        EngineChoice(
            target=target,
            drafter=drafter,
            backend=backend,
            precision=precision,
            device=device,
            max_context=max_context,
            threads=num_threads,
            cuda_graphs=cuda_graphs,
            onnx_dir=onnx_dir,
            trt_dir=trt_dir,
            mask_token_id=mask_token_id,
        )
    )


def open_pipeline(choice: EngineChoice) -> Pipeline:
    """Load the pair and build the engine `choice` names."""
    if choice.from_artifacts:
        directory = Path(choice.onnx_dir if choice.onnx_dir is not None else choice.trt_dir)
        engine = artifact_engine(choice.backend, directory, choice.max_context, choice.threads)
        if choice.precision not in ("auto", engine.precision):
            raise LoopspecError(
                f"{directory} holds {engine.precision} engines, not {choice.precision} "
                "(artifacts carry their precision: drop --precision or export again)"
            )
        return dataclasses.replace(artifact_pipeline(engine, directory), step_costs_file=_path(choice.step_costs))
    target = choice.target
    precision = resolve_precision(choice.precision, choice.backend, target)
    device = resolve_device(choice.device)
    cuda_graphs = device.type == "cuda" if choice.cuda_graphs is None else choice.cuda_graphs
    if cuda_graphs:
        require_cuda(device)  # before any model is loaded
    pair = load_pair(target, choice.drafter, mask_token=choice.mask_token_id)
    model, draft_model = pair.target, pair.drafter
    if device.type != "cpu":
        model = model.to(device)
        draft_model = draft_model.to(device) if draft_model is not None else None
    if choice.backend == "onnxruntime":
        engine = cached_ort_engine(
            model, draft_model, pair.target_dir, pair.drafter_dir, choice.max_context, choice.threads, precision, target
        )
    else:
        engine = torch_engine(model, draft_model, choice.max_context, choice.threads, cuda_graphs=cuda_graphs)
    return Pipeline(
        tokenizer=pair.tokenizer,
        target_dir=pair.target_dir,
        drafter_dir=pair.drafter_dir,
        target=model,
        drafter=draft_model,
        engine=engine,
        drafter_description=pair.drafter_description,
        stop_token_ids=pair.stop_token_ids,
        target_source=target,
        step_costs_file=_path(choice.step_costs),
    )


def _path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


def artifact_pipeline(engine: Engine, directory: Path) -> Pipeline:
    """The pipeline around an engine that runs from an artifact directory (its tokenizer and configs)."""
    tokenizer = load_tokenizer(directory / "target")
    description = f"exported ({directory})" if engine.has_drafter else "none"
    return Pipeline(
        tokenizer=tokenizer,
        target_dir=directory / "target",
        drafter_dir=None,
        target=None,
        drafter=None,
        engine=engine,
        drafter_description=description,
        stop_token_ids=stop_token_ids(engine.target_cfg, tokenizer),
    )


def cached_ort_engine(
    model: Target,
    draft_model: Drafter | None,
    target_dir: Path,
    drafter_dir: Path | None,
    max_context: int | None,
    num_threads: int | None,
    precision: str = "fp32",
    target: TargetSource | str | None = None,
) -> Engine:
    """The pair's cached ONNX export in `precision` (engines/backends.py); a gguf-* precision reads
    the blocks of `target`'s GGUF ('default' or a .gguf file; a name is resolved)."""
    gguf_path = TargetSource.of(target).require_gguf("the GGUF block precisions") if precision != "fp32" else None
    return cached_onnx_engine(
        model, draft_model, target_dir, drafter_dir, max_context, num_threads, precision, gguf_path
    )
