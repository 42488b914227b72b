#!/usr/bin/env bash
# The default target (SmolLM2-135M-Instruct) in the GGUF types CPU users download, made with
# llama.cpp's own `llama-quantize` (a measurement aid, not a dependency): the shipped Q4_1 GGUF
# requantized to each type (--allow-requantize), so every file keeps the original's metadata and
# tokenizer. Needs scripts/build_llama_server.sh's PREFIX (llama-quantize).
#
#   scripts/quantize_default_target.sh [PREFIX] [OUT] [TYPES...]   # defaults: ./llamacpp ./ggufs Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0
#
# Leaves OUT/SmolLM2-135M-Instruct-TYPE.gguf for each type; run one with
# `loopspec generate --target OUT/SmolLM2-135M-Instruct-Q4_K_M.gguf` (the shipped drafter is found by
# the model's identity) or `loopspec bench --target ... --llama-server PREFIX/bin/llama-server`.
case "${1:-}" in -h|--help) echo "usage: scripts/quantize_default_target.sh [PREFIX] [OUT] [TYPES...]"; sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail

PREFIX=$(realpath -m "${1:-llamacpp}")
OUT=$(realpath -m "${2:-ggufs}")
shift $(( $# > 2 ? 2 : $# ))
TYPES=("$@")
[ ${#TYPES[@]} -gt 0 ] || TYPES=(Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0)
PYTHON=${PYTHON:-python3}
[ -x "$PREFIX/bin/llama-quantize" ] || { echo "no $PREFIX/bin/llama-quantize: run scripts/build_llama_server.sh first" >&2; exit 2; }

mkdir -p "$OUT"
SOURCE=$("$PYTHON" -c "from loopspec.weights import default_gguf_path; print(default_gguf_path())")
for type in "${TYPES[@]}"; do
  out="$OUT/SmolLM2-135M-Instruct-$type.gguf"
  [ -f "$out" ] || "$PREFIX/bin/llama-quantize" --allow-requantize "$SOURCE" "$out" "$type" > "$out.log" 2>&1
  echo "$out"
done
