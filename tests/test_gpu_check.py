"""scripts/gpu_check.sh --dry-run: the GPU machine's one-call check rehearsed on the CPU with tiny
shapes — every check listed in the final table, none failed, the uncovered parts named, exit 0."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK_NAMES = ("gpu-marked tests", "graphs identity", "8B cost", "nvfp4 rule")


def may_skip(name: str, reason: str, has_gpu: bool) -> bool:
    """Whether a check of the dry run may be skipped: only the gpu-marked tests, and only on a
    machine where torch sees no CUDA GPU (they all skip then); every other check runs on the CPU."""
    return name == "gpu-marked tests" and not has_gpu and reason.startswith("no gpu-marked test ran")


def test_a_skip_passes_only_where_its_reason_holds():
    """The rule above: no check but the gpu-marked tests may skip, and they only without a GPU."""
    assert may_skip("gpu-marked tests", "no gpu-marked test ran (4 skipped)", has_gpu=False)
    assert not may_skip("gpu-marked tests", "no gpu-marked test ran (4 skipped)", has_gpu=True)
    assert not may_skip("gpu-marked tests", "tensorrt missing", has_gpu=False)
    assert not any(may_skip(name, "no gpu-marked test ran", has_gpu=False) for name in CHECK_NAMES[1:])


def test_gpu_check_dry_run_lists_every_check_and_passes():
    # python3 on PATH is this interpreter (the wrapper runs `python3` where the checkout has no .venv)
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    result = subprocess.run(
        ["sh", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-2000:]
    assert re.search(r"torch \S+, CUDA", out) and "transformers" in out  # versions printed first
    table = out[out.index("check             result") :]
    for name in CHECK_NAMES:
        row = re.search(rf"^{re.escape(name)}\s+(pass|skip)\s+([\d.]+)\s+(.*)$", table, re.M)
        assert row, f"{name} missing from the table or failed:\n{table}"
        result, figure = row.group(1), row.group(3).strip()
        assert result == "pass" or may_skip(name, figure, torch.cuda.is_available()), (
            f"{name} skipped where it should have run: {figure}"
        )
        assert figure, name  # a passed check states its key figure, a skipped one its reason
    assert "graphs identity   pass" in table and "identical=True" in table  # the static-buffer path, really run
    assert re.search(r"^8B cost\s+pass.*tok/s", table, re.M)
    assert "not covered: TensorRT" in out and "NVFP4" in out
    assert "every check that ran passed" in out
