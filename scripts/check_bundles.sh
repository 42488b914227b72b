#!/usr/bin/env bash
# Run vLLM's and SGLang's own configuration code on loopspec serving bundles, as a user of each engine
# would: vLLM `make_arg_parser` -> `AsyncEngineArgs.from_cli_args(...).create_engine_config()`, SGLang
# `prepare_server_args` + `ModelConfig`, each on the bundle's own launch line.
#
#     scripts/check_bundles.sh [WORK_DIR]     (default: ${TMPDIR:-/tmp}/loopspec-check-bundles)
#
# The engines go into a scratch virtualenv in WORK_DIR, outside the repository: torch 2.13 CPU first
# (so nothing below can pull a CUDA torch), then vLLM 0.33 and SGLang 0.5.23 without their
# dependencies, plus only the packages their configuration code imports. No GPU is needed. Bundles of
# the default pair are built with this checkout's `loopspec convert bundle`: bf16, tensor parallel 3
# (SmolLM2's 9 heads / 3 K/V heads split 1 or 3 ways, not 2), FP8 when nvidia-modelopt is
# installed beside loopspec, a vLLM bundle of a random DSpark drafter for the default target, vLLM and
# SGLang bundles of a random EAGLE-3 drafter for the default target (a chain; SGLang also a draft
# tree), vLLM and SGLang bundles of a random DFlash2 drafter for the default target, and vLLM and SGLang
# bundles of tiny random Qwen3-MoE, gpt-oss and Qwen3.5 targets with drafters of their own. With
# LLAMACPP_CONVERT set to llama.cpp's convert_hf_to_gguf.py (the one scripts/build_llama_server.sh
# keeps), the EAGLE-3 and DFlash2 drafters' llama.cpp bundles are also converted with it and the GGUFs
# checked. Prints one PASS/FAIL line per check; exits 1 if any check fails.
# Takes a few minutes (downloads about 500 MB once; REUSE_VENV=1 keeps a scratch environment that
# already has the pinned vLLM and SGLang). Not part of the test suite.
case "${1:-}" in -h|--help) echo "usage: scripts/check_bundles.sh [WORK_DIR]"; sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-${TMPDIR:-/tmp}/loopspec-check-bundles}"
case "$work" in "$root"|"$root"/*) echo "check_bundles: WORK_DIR must be outside the repository" >&2; exit 2;; esac
if [ -x "$root/.venv/bin/loopspec" ]; then loopspec="$root/.venv/bin/loopspec"; else loopspec="$(command -v loopspec)"; fi
loopspec_python="$(dirname "$loopspec")/python"

TORCH="torch==2.13.0+cpu"             # the CPU build: a local label no CUDA wheel carries
TORCHVISION="torchvision==0.28.0+cpu"  # SGLang's config package imports torchvision (InternVL helpers)
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
# what the engines' configuration code imports (found by running it), not their serving stacks
VLLM_CONFIG_DEPS=(transformers==5.19.0 psutil cbor2 pyzmq urllib3 aiohttp requests openai openai-harmony msgspec
                  cloudpickle pillow pybase64 cachetools uvloop py-cpuinfo fastapi prometheus_client
                  partial_json_parser xgrammar llguidance einops)
SGLANG_CONFIG_DEPS=(orjson ipython dill sentencepiece compressed-tensors gguf)

echo "== scratch environment: $work/venv (pip output in $work/install.log)"
reuse=0
if [ "${REUSE_VENV:-0}" = 1 ] && "$work/venv/bin/python" -c "import torch, vllm, sglang, transformers, sentencepiece
assert vllm.__version__.startswith('0.33.') and sglang.__version__ == '0.5.23', 'other versions'" 2>/dev/null; then
    reuse=1
    echo "   (REUSE_VENV=1: keeping the environment there)"
fi
rm -rf "$work/bundles"
if [ "$reuse" = 0 ]; then
    rm -rf "$work/venv" "$work/install.log"
    mkdir -p "$work"
    python3 -m venv "$work/venv"
    install() {  # pip install, its output kept in the log; the log's end is shown when it fails
        "$work/venv/bin/pip" install --disable-pip-version-check "$@" >> "$work/install.log" 2>&1
    }
    # every later install must keep this torch: pip fails rather than replace it
    echo "$TORCH" > "$work/constraints.txt"
    install "$TORCH" || install --index-url "$TORCH_CPU_INDEX" --extra-index-url https://pypi.org/simple "$TORCH" \
        || { tail -20 "$work/install.log"; exit 1; }
    install -c "$work/constraints.txt" "${VLLM_CONFIG_DEPS[@]}" "${SGLANG_CONFIG_DEPS[@]}" || { tail -20 "$work/install.log"; exit 1; }
    VLLM_TARGET_DEVICE=cpu install --no-deps "vllm==0.33.*" "sglang==0.5.23" || { tail -20 "$work/install.log"; exit 1; }
    # only the CPU build of torchvision loads beside a CPU torch; where it cannot be had, the SGLang
    # ModelConfig check says so instead of passing
    install --no-deps --retries 0 --timeout 20 --index-url "$TORCH_CPU_INDEX" "$TORCHVISION" \
        || install --no-deps "$TORCHVISION" || echo "   ($TORCHVISION cannot be installed here)"
fi
"$work/venv/bin/python" -c "import torch, vllm, sglang, transformers; print('   torch', torch.__version__, '| vllm',
vllm.__version__, '| sglang', sglang.__version__, '| transformers', transformers.__version__)" 2>/dev/null

echo "== bundles of the default pair ($loopspec)"
bundles=("$work/bundles/bf16" "$work/bundles/bf16-tp3")
"$loopspec" convert bundle --framework all --out "$work/bundles/bf16" > /dev/null
"$loopspec" convert bundle --framework all --tp 3 --out "$work/bundles/bf16-tp3" > /dev/null
if "$loopspec_python" -c "import modelopt" 2>/dev/null; then
    "$loopspec" convert bundle --framework all --precision fp8 --calib-size 8 --out "$work/bundles/fp8" > /dev/null
    bundles+=("$work/bundles/fp8")
else
    echo "   (no FP8 bundle: nvidia-modelopt is not installed beside loopspec)"
fi
# a DSpark drafter of DeepSpec's block convention for the default target, random weights (the engines'
# configuration code reads its config.json only): its vLLM bundle names method dspark, k = block size,
# and enable_adaptive_verification (it has a confidence head). Its SGLang launch (DSPARK) is not parsed
# here: SGLang's DSpark argument check (_handle_dspark) refuses any device but CUDA or NPU
"$loopspec_python" - "$work/dspark-drafter" <<'PY'
import sys
from dataclasses import replace

from loopspec.defaults import DEFAULT_TARGET_MASK_TOKEN_ID
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.families import target_config
from loopspec.weights import read_json, resolve_target_dir

target = target_config(read_json(resolve_target_dir("default") / "config.json", "target config"))
cfg = DrafterConfig.for_target(target, num_layers=1, block_size=7, mask_token_id=DEFAULT_TARGET_MASK_TOKEN_ID)
cfg = replace(cfg, anchor_predicts=True, markov_rank=16, confidence_head=True, confidence_with_markov=True)
Drafter(cfg).save(sys.argv[1])
PY
"$loopspec" convert bundle --framework vllm --drafter "$work/dspark-drafter" --out "$work/bundles/dspark" > /dev/null
bundles+=("$work/bundles/dspark")

# an EAGLE-3 drafter for the default target, random weights and a reduced draft vocabulary, its taps
# left to the engines' default (the bundle pins them): vLLM method eagle3 and SGLang EAGLE3 as a chain
# of 4 drafts; SGLang alone as a draft tree of 12 nodes (vLLM 0.33 drafts EAGLE-3 chains only)
"$loopspec_python" - "$work/eagle3-drafter" <<'PY'
import sys

import torch

from loopspec.model.eagle3 import fresh_eagle3
from loopspec.model.families import target_config
from loopspec.weights import read_json, resolve_target_dir

target = target_config(read_json(resolve_target_dir("default") / "config.json", "target config"))
torch.manual_seed(0)
draft_ids = torch.randperm(target.vocab_size)[:8192].sort().values
fresh_eagle3(target, block_size=5, draft_ids=draft_ids, intermediate_size=1024).save(sys.argv[1])
PY
"$loopspec" convert bundle --framework vllm,sglang --drafter "$work/eagle3-drafter" --out "$work/bundles/eagle3" > /dev/null
"$loopspec" convert bundle --framework sglang --drafter "$work/eagle3-drafter" --tree-budget 12 \
    --out "$work/bundles/eagle3-tree" > /dev/null
bundles+=("$work/bundles/eagle3" "$work/bundles/eagle3-tree")
if [ -n "${LLAMACPP_CONVERT:-}" ]; then
    # llama.cpp's own converter writes the eagle3 GGUF from the bundle (its scratch-environment Python has
    # the converter's torch, numpy, transformers and sentencepiece)
    "$loopspec" convert bundle --framework llamacpp --drafter "$work/eagle3-drafter" --out "$work/bundles/eagle3-llamacpp" > /dev/null
    LLAMACPP_CONVERT="$LLAMACPP_CONVERT" PYTHON="$work/venv/bin/python" sh "$work/bundles/eagle3-llamacpp/llamacpp/convert.sh" \
        >> "$work/install.log" 2>&1 || { tail -20 "$work/install.log"; exit 1; }
    bundles+=("$work/bundles/eagle3-llamacpp")
else
    echo "   (no llama.cpp conversion: set LLAMACPP_CONVERT to llama.cpp's convert_hf_to_gguf.py)"
fi

# a DFlash2 drafter for the default target (z-lab's DFlash2DraftModel layout, random weights, one sliding
# layer, 16 candidates a slot): vLLM method dflash and SGLang DFLASH, which pick their DFlash2 model from
# the architecture; with LLAMACPP_CONVERT, llama.cpp's own converter writes its dflash GGUF
"$loopspec_python" - "$work/dflash2-drafter" <<'PY'
import sys

import torch

from loopspec.defaults import DEFAULT_TARGET_MASK_TOKEN_ID
from loopspec.model.dflash2 import DFlash2Config, DFlash2Drafter
from loopspec.model.dflash import DrafterConfig
from loopspec.model.families import target_config
from loopspec.weights import read_json, resolve_target_dir

target = target_config(read_json(resolve_target_dir("default") / "config.json", "target config"))
base = DrafterConfig.for_target(target, num_layers=1, block_size=8, mask_token_id=DEFAULT_TARGET_MASK_TOKEN_ID)
cfg = DFlash2Config.over(base, conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=16,
                         sliding_window=2048, layer_types=("sliding_attention",), is_causal=False)
torch.manual_seed(0)
DFlash2Drafter(cfg).save(sys.argv[1], dtype=torch.float32)
PY
"$loopspec" convert bundle --framework vllm,sglang --drafter "$work/dflash2-drafter" --out "$work/bundles/dflash2" > /dev/null
bundles+=("$work/bundles/dflash2")
if [ -n "${LLAMACPP_CONVERT:-}" ]; then
    "$loopspec" convert bundle --framework llamacpp --drafter "$work/dflash2-drafter" --out "$work/bundles/dflash2-llamacpp" > /dev/null
    LLAMACPP_CONVERT="$LLAMACPP_CONVERT" PYTHON="$work/venv/bin/python" sh "$work/bundles/dflash2-llamacpp/llamacpp/convert.sh" \
        >> "$work/install.log" 2>&1 || { tail -20 "$work/install.log"; exit 1; }
    bundles+=("$work/bundles/dflash2-llamacpp")
fi

echo "== bundles of the other target families (tiny random checkpoints with the default target's tokenizer)"
"$loopspec_python" - "$work/families" <<'PY'
import shutil
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3_5TextConfig, Qwen3MoeConfig

from loopspec.defaults import DEFAULT_TARGET_MASK_TOKEN_ID
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.weights import load_target_dir, resolve_target_dir

root, tokenizer = Path(sys.argv[1]), resolve_target_dir("default")
shape = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
configs = {
    "qwen3_moe": Qwen3MoeConfig(**shape, intermediate_size=48, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2),
    "gpt_oss": GptOssConfig(**shape, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=8),
    "qwen3_5": Qwen3_5TextConfig(**shape, intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=16, linear_value_head_dim=16,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"]),
}
for family, config in configs.items():
    target_dir = root / family / "target"
    AutoModelForCausalLM.from_config(config).save_pretrained(str(target_dir))
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copyfile(f, target_dir / f.name)
    cfg = DrafterConfig.for_target(load_target_dir(target_dir).cfg, num_layers=1, block_size=8,
                                   mask_token_id=DEFAULT_TARGET_MASK_TOKEN_ID)
    Drafter(cfg).save(root / family / "drafter")
PY
for family in qwen3_moe gpt_oss qwen3_5; do
    "$loopspec" convert bundle --target "$work/families/$family/target" --drafter "$work/families/$family/drafter" \
        --framework vllm,sglang --out "$work/bundles/$family" > /dev/null
    bundles+=("$work/bundles/$family")
done

echo "== the engines' own parsers"
# CPU platform for vLLM, its log quiet; every model is a local bundle directory, so nothing is fetched from a hub.
# vLLM runs DSpark on its V2 model runner only, which it picks by itself where Triton has a GPU; here
# (Triton without a driver) it would fall back to V1 and refuse dspark, so V2 is asked for by name
VLLM_USE_V2_MODEL_RUNNER=1 VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=WARNING HF_HUB_OFFLINE=1 "$work/venv/bin/python" "$root/scripts/check_bundles_parsers.py" "${bundles[@]}"
