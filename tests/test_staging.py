"""Staged directory writes: success replaces the old directory, failure keeps it and leaves no
temporary behind, and what is in the way is refused with a clear error."""

import os
from pathlib import Path

import pytest

from loopspec.engines.staging import check_out_dir, replace_dir, staged_dir
from loopspec.errors import LoopspecError


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.endswith((".tmp", ".old")))


def test_success_writes_a_new_directory_with_its_parents(tmp_path):
    out = tmp_path / "a" / "b" / "artifact"
    with staged_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith("artifact.") and tmp.name.endswith(".tmp")
        assert not out.exists()  # nothing visible at out until the block succeeds
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"new")
    assert (out / "sub" / "w.bin").read_bytes() == b"new"
    assert leftovers(out.parent) == []


def test_success_replaces_the_old_directory_whole(tmp_path):
    out = tmp_path / "artifact"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old")
    (out / "kept-name.txt").write_text("old")
    with staged_dir(out) as tmp:
        (tmp / "kept-name.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["kept-name.txt"]  # no stale file survives
    assert (out / "kept-name.txt").read_text() == "new"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("build failed"), LoopspecError("bad input"), KeyboardInterrupt()])
def test_failure_keeps_the_old_directory_and_removes_the_temporary(tmp_path, error):
    out = tmp_path / "artifact"
    out.mkdir()
    (out / "good.bin").write_bytes(b"good")
    with pytest.raises(type(error)):
        with staged_dir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"half")
            raise error
    assert sorted(p.name for p in out.iterdir()) == ["good.bin"] and (out / "good.bin").read_bytes() == b"good"
    assert leftovers(tmp_path) == []


def test_failure_without_an_old_directory_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with staged_dir(tmp_path / "artifact") as tmp:
            (tmp / "half.bin").write_bytes(b"half")
            raise RuntimeError("export failed")
    assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_is_refused_and_kept(tmp_path):
    out = tmp_path / "artifact"
    out.write_text("my notes")
    with pytest.raises(LoopspecError, match=r"artifact exists and is a file; refusing to replace it"):
        with staged_dir(out):
            pytest.fail("the block must not run")
    assert out.read_text() == "my notes" and leftovers(tmp_path) == []
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    with pytest.raises(LoopspecError, match=r"cannot create .*blocker/artifact: cannot make its parent directory"):
        with staged_dir(blocker / "artifact"):
            pytest.fail("the block must not run")
    with pytest.raises(LoopspecError, match="is a file"):
        replace_dir(tmp_path / "nothing", out)


def test_an_unwritable_parent_is_refused(tmp_path, monkeypatch):
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    if os.access(parent, os.W_OK):  # root ignores the mode bits: make the kernel's answer the one a user gets
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == parent else real_access(path, mode))
    try:
        with pytest.raises(LoopspecError, match=r"readonly is not writable"):
            with staged_dir(parent / "artifact"):
                pytest.fail("the block must not run")
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_check_out_dir_refuses_what_is_not_an_earlier_output(tmp_path):
    assert check_out_dir(tmp_path / "new", "manifest.json", "an artifact directory") == tmp_path / "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    check_out_dir(empty, "manifest.json", "an artifact directory")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "manifest.json").write_text("{}")
    check_out_dir(earlier, "manifest.json", "an artifact directory")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.tex").write_text("mine")
    with pytest.raises(LoopspecError, match=r"busy exists and is not a bundle; refusing to overwrite it"):
        check_out_dir(busy, "manifest.json", "a bundle")
    (tmp_path / "file").write_text("x")
    with pytest.raises(LoopspecError, match=r"file exists and is a file, not a bundle"):
        check_out_dir(tmp_path / "file", "manifest.json", "a bundle")


def test_replace_dir_swaps_in_place(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "x").write_text("new")
    dst.mkdir()
    (dst / "y").write_text("old")
    assert replace_dir(src, dst) == dst
    assert not src.exists() and [p.name for p in dst.iterdir()] == ["x"] and leftovers(tmp_path) == []
