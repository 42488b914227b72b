"""`--step-costs FILE` (runtime/step_costs.py): a table is checked whole when it loads, and every bad
one is refused in one line naming the file and the field, `loopspec: error: ...` and exit 2 from
`bench`, `generate` and `serve`, before any model loads."""

import json
import socket

import pytest

from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.runtime import step_costs
from loopspec.runtime.step_costs import StepCosts

GOOD = {
    "engine": "torch fp32",
    "context": 256,
    "rows": [1, 2],
    "widths": [1, 2, 4],
    "verify_s": [[0.010, 0.011, 0.013], [0.012, 0.013, 0.016]],
    "draft_s": [0.002, 0.003],
    "cpu": "a CPU",
    "threads": 4,
}
DEEP = "[" * 100_000 + "]" * 100_000
# what the tester found accepted (or, nested 100,000 deep, a RecursionError's traceback), with the
# field each refusal names
BAD = {
    "nested 100,000 deep": (DEEP, "JSON nested deeper than 8 levels"),
    "rows [true, 2]": ({"rows": [True, 2]}, "rows must be increasing integers in [1, 65536], got [true, 2]"),
    "context 10**30": ({"context": 10**30}, "context must be an integer in [1, 16777216], got 10000000000000"),
    "context -5": ({"context": -5}, "context must be an integer in [1, 16777216], got -5"),
    'context "256"': ({"context": "256"}, 'context must be an integer in [1, 16777216], got "256"'),
    "threads -4": ({"threads": -4}, "threads must be an integer in [0, 65536] (0: not recorded), got -4"),
    "a width of 1e9": (
        json.dumps(GOOD).replace('"widths": [1, 2, 4]', '"widths": [1, 2, 1e9]'),
        "widths must be increasing integers in [1, 16776960], got [1, 2, 1000000000.0]",
    ),
    "a width of 10**9": ({"widths": [1, 2, 10**9]}, "widths must be increasing integers in [1, 16776960]"),
    "a time of true": (
        {"verify_s": [[True, 0.011, 0.013], [0.012, 0.013, 0.016]]},
        "verify_s: every time must be a number of seconds in (0, 60), got true",
    ),
}


def write(folder, name: str, content) -> str:
    path = folder / (name.replace(" ", "-").replace('"', "").replace("*", "") + ".json")
    path.write_text(content if isinstance(content, str) else json.dumps(GOOD | content))
    return str(path)


def refusal(path: str) -> str | None:
    """The one line StepCosts.load refuses `path` with (None: it loads)."""
    try:
        StepCosts.load(path)
    except LoopspecError as e:
        return str(e)
    return None


def refused_in_one_line(path: str, needle: str) -> None:
    line = refusal(path)
    assert line is not None, f"{path} loaded"
    assert "\n" not in line and line.startswith(f"step costs {path}: ") and needle in line, line


def test_a_good_table_loads(tmp_path):
    costs = StepCosts.load(write(tmp_path, "good", {}))
    assert (costs.context, costs.rows, costs.widths, costs.verify_s[1], costs.threads) == (
        256,
        (1, 2),
        (1, 2, 4),
        (0.012, 0.013, 0.016),
        4,
    )
    assert json.loads(costs.to_json()) == GOOD  # what `loopspec costs` writes reads back


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_table_is_refused_in_one_line_naming_file_and_field(case, tmp_path):
    content, needle = BAD[case]
    refused_in_one_line(write(tmp_path, case, content), needle)


@pytest.fixture(scope="module")
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def cli(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_every_command_refuses_a_bad_table_with_exit_2(command, tmp_path, capsys, free_port):
    never = str(tmp_path / "never-loaded")  # the table is refused before the target would load
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hello"]}\n')
    argv = {
        "generate": ["generate", "--prompt", "x", "--target", never],
        "bench": ["bench", "--prompts", str(prompts), "--target", never],
        "serve": ["serve", "--target", never, "--port", free_port],
    }[command]
    for case, (content, needle) in BAD.items():
        path = write(tmp_path, case, content)
        code, err = cli(argv + ["--step-costs", path], capsys)
        assert code == 2 and err.count("\n") == 1, (case, err)
        assert err.startswith(f"loopspec: error: step costs {path}: ") and needle in err, (case, err)
    # a good table passes: the next refusal is the target's
    code, err = cli(argv + ["--step-costs", write(tmp_path, "good", {})], capsys)
    assert code == 2 and err.count("\n") == 1 and "never-loaded" in err and "step costs" not in err, err


@pytest.mark.parametrize(
    "planted",
    ["true counts as an integer (the old check)", "no depth limit (the decoder's RecursionError)"],
)
def test_a_planted_bug_in_the_table_check_is_caught(planted, tmp_path, monkeypatch):
    if planted.startswith("true counts"):
        monkeypatch.setattr(step_costs, "_is_int", lambda value: isinstance(value, int))
        case = "rows [true, 2]"
    else:
        monkeypatch.setattr(step_costs, "MAX_DEPTH", 10**9)
        case = "nested 100,000 deep"
    content, needle = BAD[case]
    with pytest.raises((AssertionError, RecursionError)):
        refused_in_one_line(write(tmp_path, case, content), needle)
