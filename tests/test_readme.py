"""The README's Python examples run as written (on the real default model, hence e2e)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.M | re.S)


def test_the_readme_has_python_examples():
    assert BLOCKS, "no ```python block in README.md"


@pytest.mark.parametrize("number", range(len(BLOCKS)))
def test_readme_python_block_runs(number, capsys):
    """Each block runs in a fresh namespace and prints something; a block that prints a result's
    stats prints real ones (the decoded text, then "N tokens in ... | tau ...")."""
    block = BLOCKS[number]
    exec(compile(block, f"README.md python block {number + 1}", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert out.strip()
    if "stats.summary()" in block:
        assert re.search(r"\S.*\d+ tokens in [\d.]+s .*\| tau ", out, flags=re.S), out
