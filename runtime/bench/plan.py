"""What a `loopspec bench` run measures (BenchPlan: prompt sets, methods, how each prompt runs), its
prompts, and where its report goes (BenchOutput)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.prompt_sets import BUILTIN, read_prompt_source, source_name
from loopspec.runtime.bench.peers import PEER_METHODS
from loopspec.method_names import method_variant
from loopspec.settings import METHODS


def load_prompts(source: str | Path, limit: int | None = None, all_turns: bool = False) -> list[str]:
    """Prompts from a `{"turns": [...]}` JSONL file or a built-in set (loopspec/prompt_sets.py): the
    first turn of each conversation unless all_turns."""
    return read_prompt_source(source, limit, all_turns)


def load_prompt_sets(sources: list[str], limit: int | None = None, all_turns: bool = False) -> dict[str, list[str]]:
    """{dataset name: prompts}: a JSONL file is named by its stem, a built-in set by its name."""
    sets: dict[str, list[str]] = {}
    for source in sources:
        if not Path(source).is_file() and source not in BUILTIN:
            raise LoopspecError(f"prompt file does not exist: {source} (built-in sets: {', '.join(BUILTIN)})")
        name = source_name(source)
        if name in sets:
            raise LoopspecError(f"two prompt sets are named {name!r}: give each dataset once")
        sets[name] = load_prompts(source, limit, all_turns)
    return sets


@dataclass(frozen=True)
class BenchPlan:
    """What one bench run measures: the prompt sets (JSONL files or built-in set names), the methods
    (loopspec's, with +chain/+treeN/+suffix/+firstN variants, and the peers), and how each prompt runs.
    Checked on construction, before anything loads."""

    prompt_sets: tuple[str, ...]
    methods: tuple[str, ...]
    limit: int | None = None
    max_new_tokens: int = 128
    all_turns: bool = False
    chat: bool = True
    params: SamplingParams = SamplingParams()
    seed: int = 0
    repeats: int = 1
    cost_model: bool = False  # also measure bandwidth, t_verify(n), draft time and each method's bound
    llama_server: str | None = None  # the binary the llama.cpp peers run (None: the one on PATH)

    def __post_init__(self):
        object.__setattr__(self, "prompt_sets", tuple(self.prompt_sets))
        object.__setattr__(self, "methods", tuple(self.methods))
        if not self.methods:
            raise LoopspecError(f"no method given (choose from {', '.join(METHODS + PEER_METHODS)})")
        for m in self.methods:
            if m not in PEER_METHODS:
                method_variant(m)  # refuses unknown names and parts
        if len(set(self.methods)) != len(self.methods):
            raise LoopspecError(f"a method is named twice in {','.join(self.methods)}")
        if self.repeats < 1:
            raise LoopspecError(f"repeats must be >= 1, got {self.repeats}")
        if any(m in PEER_METHODS for m in self.methods) and not self.params.greedy:
            raise LoopspecError("the transformers and llama.cpp peers are measured greedy only (use --temperature 0)")

    @property
    def variants(self) -> dict[str, tuple[str, dict]]:
        """loopspec's methods → (method, overrides of its resolved settings)."""
        return {m: method_variant(m) for m in self.methods if m not in PEER_METHODS}

    @functools.cached_property
    def datasets(self) -> dict[str, list[str]]:
        """{dataset name: prompts} (`load_prompt_sets`), read once: a missing, malformed or non-UTF-8
        prompt file fails on first use, before the long run."""
        return load_prompt_sets(list(self.prompt_sets), self.limit, self.all_turns)


@dataclass(frozen=True)
class BenchOutput:
    """Where a bench run's report goes: `json_out` (bench.json alone), `out_dir` (bench.json, bench.md
    and the plots), and the command recorded in it."""

    json_out: str | None = None
    out_dir: str | None = None
    command: str | None = None
