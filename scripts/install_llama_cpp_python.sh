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
  DEFAULT_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON"
  if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    # ggml's AMX matmuls crash with a general protection fault on the AMX VMs here (any
    # prompt of 2+ tokens; llama.cpp issue 20824); GGML_NATIVE turns them on, so name the
    # AVX-512 sets instead and leave AMX out.
    DEFAULT_ARGS="-DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    DEFAULT_ARGS="$DEFAULT_ARGS -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    DEFAULT_ARGS="$DEFAULT_ARGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  CMAKE_ARGS="${CMAKE_ARGS:-$DEFAULT_ARGS}" \
    "$VENV/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python "$SPEC"
fi
"$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)' 2>/dev/null | tail -1
echo "$VENV/bin/python"
