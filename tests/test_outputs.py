"""Output paths are reserved before a run by creating them (loopspec/files.py output_file,
output_dir) and given back when the run fails having written nothing into them."""

import os

import pytest

from loopspec.errors import LoopspecError
from loopspec.files import output_dir, output_file


class RunFailed(Exception):
    pass


def test_an_output_file_is_created_before_the_run_and_removed_when_it_fails(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(RunFailed):
        with output_file(path, "--json") as reserved:
            assert reserved == path and path.is_file()  # writable, known before the run
            raise RunFailed
    assert not path.exists()
    with output_file(path, "--json"):
        path.write_text("{}")
    assert path.read_text() == "{}"
    with pytest.raises(RunFailed):  # a file that was there is left as it was
        with output_file(path, "--json"):
            raise RunFailed
    assert path.read_text() == "{}"
    appended = tmp_path / "prompts.jsonl"  # what a failing run wrote into its new file stays
    with pytest.raises(RunFailed):
        with output_file(appended, "--out"):
            appended.write_text('{"turns": ["kept"]}\n')
            raise RunFailed
    assert appended.is_file()
    with output_file(None, "--json") as nothing:
        assert nothing is None


@pytest.mark.parametrize(
    "where, says",
    [("/proc/x.json", "cannot write there"), ("{tmp}", "is a directory"), ("{tmp}/missing/x.json", "does not exist")],
)
def test_an_output_file_that_cannot_be_written_is_one_line(tmp_path, where, says):
    path = where.format(tmp=tmp_path)
    with pytest.raises(LoopspecError, match=f"^--json {path}.*{says}"):
        with output_file(path, "--json"):
            pytest.fail("the run must not start")
    assert os.listdir(tmp_path) == []


def test_an_output_dir_is_created_before_the_run_and_removed_when_it_fails_empty(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(RunFailed):
        with output_dir(out, "--out"):
            assert out.is_dir() and os.listdir(out) == []  # the probe is gone
            raise RunFailed
    assert os.listdir(tmp_path) == []  # both folders it made
    with pytest.raises(RunFailed):  # a resumable run's checkpoint stays
        with output_dir(out, "--out"):
            (out / "checkpoint").write_text("step 2")
            raise RunFailed
    assert (out / "checkpoint").read_text() == "step 2"
    with pytest.raises(LoopspecError, match="^--out /proc/x: cannot write there"):
        with output_dir("/proc/x", "--out"):
            pytest.fail("the run must not start")
    with pytest.raises(LoopspecError, match="^--out is not a directory: "):
        with output_dir(out / "checkpoint", "--out"):
            pytest.fail("the run must not start")
