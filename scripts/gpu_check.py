"""One prepared GPU check that completes in one call of at most 9 minutes (see docs/conversion.md).

    scripts/gpu_check.sh [--dry-run]          # the sh wrapper sets PYTHONPATH to this checkout

Written for a machine with one NVIDIA GPU, a CUDA build of torch, transformers, onnx and onnxruntime,
and nothing else: no network (nothing is installed), no TensorRT, no modelopt, no gguf package, and
no default model (its 98 MB GGUF is over what travels to the machine), so every model is built there.
Each check runs in its own process under its own timeout (they sum to under 9 minutes); one table
lists every check (result, seconds, key figure) and the exit status is 1 when any check failed.

--dry-run runs the same steps with tiny shapes on the CPU: the gpu-marked tests skip, the CUDA-graph
identity runs through the graphs' static-buffer path without capture (StaticRunner), and the cost
run takes its tiny shapes; the test suite runs it (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = "FIGURE:"  # a check's last line starting with this is its key figure in the table
SKIP = "SKIP:"  # a check that prints this (and exits 0) was skipped, with the reason

# (name, timeout in seconds): 150 + 100 + 240 + 30 = 520 s < 9 minutes, with the start-up around them
CHECKS = (("gpu-marked tests", 150), ("graphs identity", 100), ("8B cost", 240), ("nvfp4 rule", 30))
NOT_COVERED = (
    "TensorRT plans (TensorRT is not installed there)",
    "NVFP4 kernels (needs Blackwell, compute 10.0)",
    "FP8 kernels through TensorRT",
    "the default pair (its GGUF does not travel)",
    "modelopt calibration",
    "the HTTP server (no FastAPI)",
)


def versions() -> list[str]:
    import torch

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        lines.append(
            f"GPU {torch.cuda.get_device_name()}, compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}"
        )
    else:
        lines.append("GPU: none seen by torch")
    found = []
    for name in ("transformers", "onnx", "onnxruntime", "tensorrt", "modelopt"):
        if importlib.util.find_spec(name) is None:
            found.append(f"{name} absent")
        else:
            module = __import__(name)
            found.append(f"{name} {getattr(module, '__version__', '?')}")
    return lines + [", ".join(found)]


# ---- the checks (each one runs as `gpu_check.py --check NAME` in its own process) -----------------


def check_gpu_tests(dry_run: bool) -> int:
    """The gpu-marked tests: CUDA-graph replay = eager (batched rows, trees), batched greedy identity;
    TensorRT parity (skipped without TensorRT). Without a GPU they all skip."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "tests/test_cuda_graphs.py",
            "tests/test_trt.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    tail = [line for line in result.stdout.strip().splitlines() if line.strip()]
    print("\n".join(tail[-15:]))
    summary = tail[-1] if tail else "no pytest output"
    if result.returncode == 5 or (result.returncode == 0 and " passed" not in summary):  # all skipped
        print(f"{SKIP} no gpu-marked test ran ({summary})")
        return 0
    print(f"{FIGURE} {summary}")
    return result.returncode


def check_graphs_identity(dry_run: bool) -> int:
    """A lively tiny pair built here: CUDA graphs (dry run: their static-buffer path) against eager —
    logit parity of a batched verify, and four rows decoded together with ar, dflash, dloop and dloop
    with trees + suffix, each equal to plain decoding alone, with varied output (>= 8 distinct tokens)."""
    import tempfile

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import lively, save_tiny_target
    from test_cuda_graphs import (
        IDENTITY_METHODS,
        MIN_DISTINCT,
        StaticEngine,
        identity_mismatches,
        identity_prompts,
        plain_decoding,
        random_drafter,
    )

    from loopspec.engines.torch_engine import TorchEngine
    from loopspec.weights import load_target_dir

    device = "cpu" if dry_run else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        target = lively(load_target_dir(save_tiny_target("qwen3", Path(tmp) / "target", seed=2))).to(device)
    drafter = random_drafter(target).to(device)
    eager = TorchEngine(target, drafter, max_context=160)
    graphs = (
        StaticEngine(target, drafter, 160)
        if dry_run
        else TorchEngine(target, drafter, max_context=160, cuda_graphs=True)
    )
    prompts = identity_prompts(2 if dry_run else 4)  # the dry run: two rows (row offsets), in seconds
    with torch.inference_mode():
        refs = plain_decoding(eager, prompts)
        twins = [e.with_rows(2) for e in (eager, graphs)]
        for engine in twins:
            for row in range(2):
                engine.prefill(row, prompts[row], want_taps=True)
        (el, _), (gl, _) = (e.verify([[5, 6, 7], [8]], want_taps=True) for e in twins)
        parity = max(float((gl[0, :3] - el[0, :3]).abs().max()), float((gl[1, :1] - el[1, :1]).abs().max()))
        mismatches = identity_mismatches(graphs, prompts, refs)
    distinct = min(len(set(r)) for r in refs)
    print(f"parity max |logit graphs - eager| = {parity:.2e}; identity mismatches: {mismatches or 'none'}")
    print(
        f"{FIGURE} {len(IDENTITY_METHODS)} methods x {len(prompts)} rows identical={not mismatches}, "
        f">= {distinct} distinct tokens, parity {parity:.1e}"
    )
    return 0 if not mismatches and parity <= 1e-3 and distinct >= MIN_DISTINCT else 1


def check_cost(dry_run: bool) -> int:
    """scripts/gpu_cost.py: the 8B-shaped cost run (dry run: tiny shapes)."""
    import json
    import tempfile

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_cost

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpu_cost.json"
        code = gpu_cost.main((["--dry-run"] if dry_run else []) + ["--out", str(out)])
        report = json.loads(out.read_text()) if out.is_file() else None
    if report:
        mode = report["graphs"].get("on", {})
        runs = mode.get("runs", {})
        dflash = runs.get("dflash@1", {})
        print(
            f"{FIGURE} graphs on: ar {runs.get('ar@1', {}).get('tokens_per_s')} tok/s, dflash "
            f"{dflash.get('tokens_per_s')} tok/s (tau {dflash.get('tau')}, overhead {dflash.get('overhead')})"
        )
    return code


def check_nvfp4_rule(dry_run: bool) -> int:
    """NVFP4 plans are refused below Blackwell (the H200 is 9.0); allowed on compute capability >= 10.0."""
    import torch

    from loopspec.engines.trt_engine import check_precision_supported
    from loopspec.errors import LoopspecError

    if dry_run or not torch.cuda.is_available():
        capability, name = (9, 0), "NVIDIA H200 (as the GPU machine reports it)"
    else:
        capability, name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
    try:
        check_precision_supported("nvfp4", capability, name)
        allowed = True
    except LoopspecError as e:
        allowed = False
        print(f"refused: {e}")
    ok = allowed == (tuple(capability) >= (10, 0))
    print(f"{FIGURE} nvfp4 {'allowed' if allowed else 'refused'} at {capability[0]}.{capability[1]}")
    return 0 if ok else 1


RUNNERS = {
    "gpu-marked tests": check_gpu_tests,
    "graphs identity": check_graphs_identity,
    "8B cost": check_cost,
    "nvfp4 rule": check_nvfp4_rule,
}


# ---- the driver -----------------------------------------------------------------------------------


def run_check(name: str, timeout: int, dry_run: bool) -> tuple[str, float, str]:
    """Run one check in its own process → (pass | fail | skip | timeout, seconds, key figure or reason)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--check", name] + (["--dry-run"] if dry_run else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    try:
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out)
        return "timeout", time.perf_counter() - t0, f"over its {timeout} s"
    seconds = time.perf_counter() - t0
    print(result.stdout.rstrip())
    if result.returncode:
        print(result.stderr.rstrip()[-3000:])
    lines = result.stdout.strip().splitlines()
    skip = next((line[len(SKIP) :].strip() for line in lines if line.startswith(SKIP)), None)
    figure = next((line[len(FIGURE) :].strip() for line in reversed(lines) if line.startswith(FIGURE)), "")
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["exit status %d" % result.returncode])[-1]
        return "fail", seconds, figure or last[:100]
    return ("skip", seconds, skip) if skip is not None else ("pass", seconds, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (CUDA graphs: their CPU path)")
    parser.add_argument("--check", choices=list(RUNNERS), help=argparse.SUPPRESS)  # one check, in its own process
    args = parser.parse_args(argv)
    if args.check:
        if args.dry_run:
            import torch

            torch.set_num_threads(1)  # tiny shapes on a shared CPU: more threads only wait on each other
        return RUNNERS[args.check](args.dry_run)

    import torch

    print("== gpu_check" + (" (dry run: tiny shapes on the CPU)" if args.dry_run else ""))
    print("\n".join(versions()))
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU; run with --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    rows = []
    for name, timeout in CHECKS:
        print(f"\n== {name} (timeout {timeout} s)", flush=True)
        rows.append((name, *run_check(name, timeout, args.dry_run)))
    print(f"\n{'check':<18}{'result':<9}{'seconds':>8}  key figure")
    for name, result, seconds, figure in rows:
        print(f"{name:<18}{result:<9}{seconds:>8.1f}  {figure}")
    print("not covered: " + "; ".join(NOT_COVERED))
    failed = [name for name, result, *_ in rows if result in ("fail", "timeout")]
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'every check that ran passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
