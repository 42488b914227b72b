#!/bin/sh
# Build a serving bundle once (loopspec convert bundle) and launch it with its engine.
#   scripts/serve_bundle.sh ENGINE BUNDLE_DIR [convert-bundle flags ...] [-- engine flags ...]
# ENGINE: trtllm | vllm | sglang. Without --target/--drafter the bundle holds the default pair.
# The bundle is built only when BUNDLE_DIR/ENGINE/launch.sh is missing (delete the dir to rebuild).
set -eu
USAGE="usage: $0 trtllm|vllm|sglang BUNDLE_DIR [bundle flags...] [-- engine flags...]"
case "${1:-}" in -h|--help) echo "$USAGE"; sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
ENGINE=${1:?$USAGE}
BUNDLE=${2:?$USAGE}
shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOOPSPEC=loopspec
[ -x "$ROOT/.venv/bin/loopspec" ] && LOOPSPEC="$ROOT/.venv/bin/loopspec"

build() {  # build "COUNT ARGS...": the first COUNT of ARGS are `convert bundle` flags
    count=$1
    shift
    i=0
    for arg in "$@"; do  # keep the first COUNT arguments
        shift
        [ "$i" -lt "$count" ] && set -- "$@" "$arg"
        i=$((i + 1))
    done
    "$LOOPSPEC" convert bundle --framework "$ENGINE" --out "$BUNDLE" "$@"
}

n=0  # flags before "--" are for `loopspec convert bundle`, the rest for the engine
for arg in "$@"; do
    [ "$arg" = "--" ] && break
    n=$((n + 1))
done
[ -x "$BUNDLE/$ENGINE/launch.sh" ] || build "$n" "$@"
shift "$n"
[ "${1:-}" = "--" ] && shift
exec "$BUNDLE/$ENGINE/launch.sh" "$@"
