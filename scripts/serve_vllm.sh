#!/bin/sh
# Serve with vLLM: build the bundle once (default pair unless --target/--drafter), then launch it.
#   scripts/serve_vllm.sh BUNDLE_DIR [convert-bundle flags, e.g. --tp 2 --precision fp8] [-- engine flags]
exec "$(dirname "$0")/serve_bundle.sh" vllm "$@"
