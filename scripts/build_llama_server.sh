#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp vendored in the llama-cpp-python==0.3.36 sdist:
# that version runs DFlash drafters (`--spec-type draft-dflash`). Needs cmake and a C++
# compiler; about 15 minutes on 2 cores.
#
#   scripts/build_llama_server.sh [PREFIX]        # PREFIX defaults to ./llamacpp
#
# Leaves PREFIX/bin/llama-server, PREFIX/bin/llama-bench (the step timings beside loopspec's:
# scripts/step_times.py --llama-bench) and PREFIX/bin/llama-quantize (other block types of a GGUF:
# scripts/quantize_default_target.sh); point `loopspec bench --llama-server PREFIX/bin/llama-server` at it
# (or put it on PATH). The sdist's own convert_hf_to_gguf.py and gguf-py are kept under PREFIX/src.
case "${1:-}" in -h|--help) echo "usage: scripts/build_llama_server.sh [PREFIX]"; sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail

PREFIX=$(realpath -m "${1:-llamacpp}")
VERSION=0.3.36
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

mkdir -p "$PREFIX/src" "$PREFIX/bin"
cd "$PREFIX/src"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PYTHON" -m pip download --quiet --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" -d .
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$PREFIX/src/llama_cpp_python-$VERSION/vendor/llama.cpp"

# Native code for this CPU (AVX-512/VNNI where present), no network code, no shared-library juggling.
cmake -S "$SRC" -B "$PREFIX/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$PREFIX/build" --target llama-server llama-bench llama-quantize -j "$JOBS"
cp "$PREFIX/build/bin/llama-server" "$PREFIX/build/bin/llama-bench" "$PREFIX/build/bin/llama-quantize" "$PREFIX/bin/"
"$PREFIX/bin/llama-server" --version 2>&1 | head -n 2
echo "built $PREFIX/bin/llama-server, $PREFIX/bin/llama-bench and $PREFIX/bin/llama-quantize"
