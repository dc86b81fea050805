#!/usr/bin/env bash
# Install llama-cpp-python (llama.cpp built from PyPI's source distribution for
# this CPU) into its own virtual environment, for side-by-side benchmarks
# (`pagedserve bench compare --llama-cpp-python <the python it prints>`) and for
# `pagedserve bench make-gguf`, which uses its quantizer.
# Usage: scripts/install_llama_cpp_python.sh [VENV_DIR]
#   VENV_DIR default: ~/.cache/pagedserve/peers/llama-cpp; LLAMA_CPP_PYTHON_VERSION
#   pins a release (default: the newest). Compiling takes a few minutes.
# Idempotent: an existing venv that imports llama_cpp is kept. The last line
# printed is the venv's python.
set -euo pipefail
VENV="${1:-$HOME/.cache/pagedserve/peers/llama-cpp}"
SPEC="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import llama_cpp' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  # GGML_NATIVE builds for this CPU's instruction set (AVX-512, VNNI, BF16 where present),
  # as pagedserve's kernels are; OpenMP threads as pagedserve's do.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON}" \
    "$VENV/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python "$SPEC"
fi
"$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)' 2>/dev/null | tail -1
echo "$VENV/bin/python"
