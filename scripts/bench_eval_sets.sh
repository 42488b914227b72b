#!/bin/sh
# Benchmark the default pair on the five eval sets in ONE `loopspec bench` run (same prompts, same
# process for every method and peer): bench.json, bench.md and the PNG plots land in OUT_DIR.
#   scripts/bench_eval_sets.sh EVAL_DIR|none OUT_DIR [METHODS] [extra bench flags...]
# humaneval and mt-bench are built-in sets (python -m loopspec.prompt_sets); mbpp, math500 and alpaca
# ship in no package, so they are read from EVAL_DIR/{mbpp,math500,alpaca}.jsonl, files of your own
# ({"turns": [...]} per line; docs/benchmarks.md names their public sources), or left out with `none`.
# (relative paths are taken from the repository root)
# e.g. scripts/bench_eval_sets.sh none docs/bench ar,dflash,dloop,hf,hf-lookup --cost-model
set -eu
EVAL=${1:?usage: $0 EVAL_DIR|none OUT_DIR [METHODS] [flags...]}
OUT=${2:?usage: $0 EVAL_DIR|none OUT_DIR [METHODS] [flags...]}
METHODS=${3:-ar,dflash,dloop,hf,hf-lookup}
shift 3 2>/dev/null || shift $#
cd "$(dirname "$0")/.."
# the extra flags come last, so that they override the defaults here (e.g. --limit 10)
if [ "$EVAL" = none ]; then
    .venv/bin/loopspec bench --prompts humaneval mt-bench --limit 20 --max-new-tokens 128 \
        --methods "$METHODS" --out "$OUT" "$@"
else
    .venv/bin/loopspec bench --prompts humaneval "$EVAL/mbpp.jsonl" "$EVAL/math500.jsonl" mt-bench \
        "$EVAL/alpaca.jsonl" --limit 20 --max-new-tokens 128 --methods "$METHODS" --out "$OUT" "$@"
fi
