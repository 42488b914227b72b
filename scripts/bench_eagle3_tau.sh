#!/bin/sh
# τ of an EAGLE-3 drafter against the shipped DFlash drafter (v6d), and of DLoop over the EAGLE-3
# drafter, on the split v6d's τ is measured on: the five eval sets, first 20 prompts each, 128 new
# tokens, greedy, the chain at block 8 (no tree, no suffix branch, no adaptive fallback), the torch
# engine in fp32 for both (an EAGLE-3 drafter runs on the torch engine only). τ does not depend on
# the machine's load, so these runs may share it; their tokens/s are not figures.
#   scripts/bench_eagle3_tau.sh [EAGLE3_DIR] [OUT]
case "${1:-}" in -h|--help) echo "usage: scripts/bench_eagle3_tau.sh [EAGLE3_DIR] [OUT]"; sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -eu
cd "$(dirname "$0")/.."
E3=${1:-loopspec/drafters/smollm2-135m-instruct-eagle3}
OUT=${2:-docs/runs/2026-12-06/eagle3-tau}
BENCH="nice -n 19 .venv/bin/loopspec bench --prompts humaneval mbpp math500 mt-bench alpaca --limit 20 \
    --max-new-tokens 128 --backend torch --precision fp32 --threads 2 --block-size 8 --tree-budget 0 --no-suffix \
    --suffix-first 0 --no-adaptive"
# the chains: v6d's and the EAGLE-3 drafter's, each beside its own `ar`
$BENCH --methods ar,dflash+chain --drafter loopspec/drafters/smollm2-135m-instruct --out "$OUT/v6d-chain"
$BENCH --methods ar,dflash+chain --drafter "$E3" --out "$OUT/eagle3-chain"
# DLoop over the EAGLE-3 drafter: up to 3 stages of 7 drafts, a stage going on while the summed
# log-probability of the stage's drafts reaches the gate
for gate in -0.5 -1 -2; do
    $BENCH --methods ar,dloop+chain --max-stages 3 --gate-threshold=$gate --drafter "$E3" \
        --out "$OUT/eagle3-dloop-s3-g$gate"
done
