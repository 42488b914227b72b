#!/bin/sh
# Benchmark the default pair on the five eval sets in one process (same prompts for every method).
#   scripts/bench_eval_sets.sh PATH/TO/shared/data/eval OUT.json [METHODS] [extra bench flags...]
set -eu
EVAL=${1:?usage: $0 EVAL_DIR OUT.json [METHODS] [flags...]}
OUT=${2:?usage: $0 EVAL_DIR OUT.json [METHODS] [flags...]}
METHODS=${3:-ar,dflash}
shift 3 2>/dev/null || shift $#
cd "$(dirname "$0")/.."
.venv/bin/loopspec bench --prompts "$EVAL/humaneval.jsonl" "$EVAL/mbpp.jsonl" "$EVAL/math500.jsonl" \
    "$EVAL/mt-bench.jsonl" "$EVAL/alpaca.jsonl" --limit 20 --max-new-tokens 128 --methods "$METHODS" \
    --json "$OUT" "$@"
