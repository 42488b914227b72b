"""Every file in scripts/ answers --help: it prints its usage and exits 0 at once, without loading a
model or importing an optional library. The tests import no script and most scripts never run under
test, so this is what notices one that an edit of loopspec broke at import (a name it imports gone,
a moved module). A Python script has a main() behind `if __name__ == "__main__":`, with argparse, and
does nothing at import but define things; a shell script answers -h / --help before anything else.
Discovered by glob: a new script is covered as it lands. (That scripts reach no private member of
loopspec is tests/test_layout.py's.)"""

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_layout import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh"))
TIMEOUT_S = 60  # one --help; each takes about 2 s (a loopspec import) or far less
# libraries a script may use, imported inside the function that needs it (they are not loopspec's
# dependencies, or cost seconds to import): optional ones and those only a script uses
LAZY = OPTIONAL | {"onnxruntime_genai", "llguidance", "specforge", "torchvision"}


def help_command(path: Path) -> list[str]:
    return [sys.executable, str(path), "--help"] if path.suffix == ".py" else ["bash", str(path), "--help"]


def run_help(path: Path) -> subprocess.CompletedProcess | str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(
            help_command(path),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"still running after {TIMEOUT_S} s"


@pytest.fixture(scope="module")
def help_runs(request):
    """{script: its --help run, as a future}: the selected scripts' runs start at once, one per core
    (2 to 4 at a time; each is mostly one import), so the file takes a fraction of their sum."""
    wanted = [
        item.callspec.params["script"]
        for item in request.session.items
        if item.path == Path(__file__) and getattr(item, "originalname", None) == "test_help"
    ]
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        yield {path: pool.submit(run_help, path) for path in dict.fromkeys(wanted)}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help(script, help_runs):
    result = help_runs[script].result() if script in help_runs else run_help(script)
    assert not isinstance(result, str), f"{script.name} --help: {result}"
    assert result.returncode == 0, f"{script.name} --help exited {result.returncode}:\n{result.stderr[-3000:]}"
    assert "usage" in result.stdout.lower(), f"{script.name} --help printed no usage:\n{result.stdout[:2000]}"


def is_main_guard(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def main_guard_problems(path: Path) -> list[str]:
    """What keeps a Python script from the house rules: a module-level main() (argparse), called behind
    `if __name__ == "__main__":`; nothing at module level but the docstring, imports, definitions and
    assignments (none calling what it imported from loopspec: a model loaded at import); no optional or
    script-only library (LAZY) imported at module level."""
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    tree = ast.parse(path.read_text(), str(path))
    problems, loopspec_names = [], set()
    if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
        problems.append(f"{label}: no module-level main()")
    guards = [n for n in tree.body if is_main_guard(n)]
    if not guards:
        problems.append(f'{label}: no `if __name__ == "__main__":` (its work runs on import)')
    elif not any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "main"
        for g in guards
        for n in ast.walk(g)
    ):
        problems.append(f'{label}:{guards[0].lineno}: `if __name__ == "__main__":` does not call main()')
    if not any(
        isinstance(n, (ast.Import, ast.ImportFrom))
        and "argparse" in ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module])
        for n in ast.walk(tree)
    ):
        problems.append(f"{label}: no argparse (--help is argparse's)")
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.split(".")[0] in LAZY:
                    problems.append(
                        f"{label}:{node.lineno}: imports {module} at module level (import it in "
                        "the function that needs it)"
                    )
                if module.split(".")[0] == "loopspec" and isinstance(node, ast.ImportFrom):
                    loopspec_names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or is_main_guard(node):
            continue
        elif i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
            if any(isinstance(c.func, ast.Name) and c.func.id in loopspec_names for c in calls):
                problems.append(f"{label}:{node.lineno}: calls loopspec at import (move it into main())")
        else:
            problems.append(
                f"{label}:{node.lineno}: a {type(node).__name__} statement at module level runs on "
                "import (move it into main())"
            )
    return problems


def test_python_scripts_keep_their_work_in_main():
    problems = [p for path in SCRIPTS if path.suffix == ".py" for p in main_guard_problems(path)]
    assert not problems, "\n".join(problems)


# a shell script that only hands its arguments to a Python script (-h / --help included: argparse answers)
DELEGATES = {"gpu_check.sh": "scripts/gpu_check.py"}
HELP_CASE = 'case "${1:-}" in -h|--help)'


def test_shell_scripts_answer_help_first():
    """A shell script's first command (past comments, `set` and its usage text) answers -h / --help,
    before any cd, install or run; a DELEGATES one sets up nothing but the Python it runs and ends
    handing "$@" to its Python script."""
    problems = []
    for path in SCRIPTS:
        if path.suffix != ".sh":
            continue
        commands = [
            line.strip()
            for line in path.read_text().splitlines()[1:]
            if line.strip() and not line.lstrip().startswith(("#", "set ", "USAGE="))
        ]
        if path.name in DELEGATES:
            if not (
                commands
                and DELEGATES[path.name] in commands[-1]
                and commands[-1].endswith('"$@"')
                and commands[-1].startswith(("exec ", 'PYTHONPATH="$(pwd)'))
            ):
                problems.append(f'{path.name}: does not end handing "$@" to {DELEGATES[path.name]}')
        elif not (commands and commands[0].startswith(HELP_CASE)):
            problems.append(f"{path.name}: first command {(commands or [''])[0][:80]!r}")
    assert not problems, f"answer -h/--help first ({HELP_CASE} ... exit 0 ;; esac):\n" + "\n".join(problems)


def test_main_guard_check_catches_a_planted_script(tmp_path):
    """A script whose work runs at import (what scripts/draft_sampling_tau.py once was) is caught; so is
    an optional library imported at module level; the same script with its work in main() is not.
    --help alone would not catch the first: argparse answers it even at module level."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Planted."""\n'
        "import argparse\n"
        "from loopspec.runtime.pipeline import load_pipeline\n"
        "import vllm\n"
        "args = argparse.ArgumentParser().parse_args()\n"
        "pipe = load_pipeline()\n"
        "for mode in ('a', 'b'):\n"
        "    print(pipe.run(mode))\n"
    )
    problems = main_guard_problems(planted)
    assert problems == [
        "planted.py: no module-level main()",
        'planted.py: no `if __name__ == "__main__":` (its work runs on import)',
        "planted.py:4: imports vllm at module level (import it in the function that needs it)",
        "planted.py:6: calls loopspec at import (move it into main())",
        "planted.py:7: a For statement at module level runs on import (move it into main())",
    ]
    fixed = tmp_path / "fixed.py"
    fixed.write_text(
        '"""Fixed."""\n'
        "import argparse\n"
        "from loopspec.runtime.pipeline import load_pipeline\n"
        "MODES = tuple('ab')\n"
        "\n"
        "def main():\n"
        "    args = argparse.ArgumentParser().parse_args()\n"
        "    import vllm\n"
        "    pipe = load_pipeline()\n"
        "    return 0\n"
        "\n"
        'if __name__ == "__main__":\n'
        "    raise SystemExit(main())\n"
    )
    assert main_guard_problems(fixed) == []
    result = run_help(fixed)  # and it answers --help without loading anything
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result
