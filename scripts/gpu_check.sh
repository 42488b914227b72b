#!/bin/sh
# One prepared GPU check in one call of at most 9 minutes; the logic is scripts/gpu_check.py.
#   scripts/gpu_check.sh [--dry-run]
# Nothing is installed (the GPU machine has no network): loopspec is imported from this checkout.
# Exit status 0 only when every check that ran passed.
set -u
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" exec $PY scripts/gpu_check.py "$@"
