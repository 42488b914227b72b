#!/bin/sh
# Serve with vLLM: build the bundle once (default pair unless --target/--drafter), then launch it.
#   scripts/serve_vllm.sh BUNDLE_DIR [convert-bundle flags, e.g. --tp 2 --precision fp8] [-- engine flags]
case "${1:-}" in -h|--help) echo "usage: scripts/serve_vllm.sh BUNDLE_DIR [convert-bundle flags...] [-- engine flags...]"; sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
exec "$(dirname "$0")/serve_bundle.sh" vllm "$@"
