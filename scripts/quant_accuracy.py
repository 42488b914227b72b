"""The quantized drafter's accuracy against the fp32 drafter, FP8 beside NVFP4, on one machine's CPU.

    PYTHONPATH=. OMP_NUM_THREADS=2 .venv/bin/python scripts/quant_accuracy.py [--target default]
        [--drafter default] [--calib-size 16] [--out quant_accuracy.json]

Both precisions are calibrated by modelopt exactly as `loopspec convert quantize` does (the built-in
prompts, max calibration) and measured the same way, through the PyTorch modules their graphs are
exported from (FP8: the Q/DQ ONNX Runtime also computes; NVFP4: the emulation of TensorRT's FP4
kernels), on the held-out prompts of convert/validate.py: draft-logit error, top-1 agreement and
offline τ against the fp32 drafter. Prints one table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--calib-size", type=int, default=16)
    parser.add_argument("--out", default="quant_accuracy.json")
    args = parser.parse_args()

    from loopspec.convert import quantize as Q
    from loopspec.convert.validate import PROMPT_TEXTS
    from loopspec.pair import load_pair

    pair = load_pair(args.target, args.drafter, trained=True)
    prompts = Q.read_calib_prompts(None)
    calibration = Q.calibration_sequences(pair.target, pair.tokenizer, prompts, args.calib_size)
    held_out = Q.calibration_sequences(pair.target, pair.tokenizer, list(PROMPT_TEXTS), len(PROMPT_TEXTS))
    rows = {}
    for precision in ("fp8", "nvfp4"):
        t0 = time.perf_counter()
        calibrated = Q.quantize_drafter(pair.drafter, pair.target, calibration, precision)
        weights = Q.quantized_weights(calibrated)
        rows[precision] = Q.emulated_drafter_check(pair.target, pair.drafter, weights, held_out, precision)
        rows[precision]["quantized_linears"] = len(weights)
        rows[precision]["seconds"] = round(time.perf_counter() - t0, 1)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_name(),
        "target": args.target,
        "drafter": args.drafter,
        "calib_size": len(calibration),
        "held_out_prompts": len(held_out),
        "precisions": rows,
    }
    print(f"{report['date']}, {report['cpu']}: {len(calibration)} calibration prompts, {len(held_out)} held-out")
    print(
        f"{'precision':<10}{'max |err|':>10}{'mean |err|':>11}{'scale':>8}{'top-1':>8}{'tau fp32':>9}"
        f"{'tau q':>8}{'drop':>8}{'s':>7}"
    )
    for precision, r in rows.items():
        print(
            f"{precision:<10}{r['max_abs']:>10.3g}{r['mean_abs']:>11.3g}{r['logit_scale']:>8.3g}"
            f"{r['top1_agreement']:>8.1%}{r['tau_reference']:>9.3f}{r['tau_quantized']:>8.3f}"
            f"{r['tau_relative_drop']:>+8.1%}{r['seconds']:>7.1f}"
        )
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
