#!/bin/sh
# Benchmark the default pair on the five eval sets in ONE `loopspec bench` run (same prompts, same
# process for every method and peer): bench.json, bench.md and the PNG plots land in OUT_DIR.
#   scripts/bench_eval_sets.sh PATH/TO/shared/data/eval OUT_DIR [METHODS] [extra bench flags...]
# (relative paths are taken from the repository root)
# e.g. scripts/bench_eval_sets.sh ../shared/data/eval docs/bench ar,dflash,dloop,hf,hf-lookup --cost-model
set -eu
EVAL=${1:?usage: $0 EVAL_DIR OUT_DIR [METHODS] [flags...]}
OUT=${2:?usage: $0 EVAL_DIR OUT_DIR [METHODS] [flags...]}
METHODS=${3:-ar,dflash,dloop,hf,hf-lookup}
shift 3 2>/dev/null || shift $#
cd "$(dirname "$0")/.."
.venv/bin/loopspec bench --prompts "$EVAL/humaneval.jsonl" "$EVAL/mbpp.jsonl" "$EVAL/math500.jsonl" \
    "$EVAL/mt-bench.jsonl" "$EVAL/alpaca.jsonl" --limit 20 --max-new-tokens 128 --methods "$METHODS" \
    --out "$OUT" "$@"
