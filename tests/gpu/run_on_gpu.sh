#!/usr/bin/env bash
# The one prepared script for a fresh GPU machine (no network; torch, triton and transformers
# installed): installs the bundled wheels (`make gpu-bundle` builds build/gpu-bundle/, carried
# with the working tree), then runs tests/gpu/gpu_run.py, which writes ONE JSON file to
# $OUT/gpu_run.json (or --out PATH) within about 7.5 minutes.
#   tests/gpu/run_on_gpu.sh [--dry-run] [--model REAL_MODEL_DIR] [--out PATH] [--budget-s SECONDS]
# --dry-run (or a machine without CUDA) runs only the plumbing: every CUDA stage is recorded
# as skipped with its reason.
set -u
cd "$(dirname "$0")/../.." || exit 2

# The Python: $PYTHON if set, else the first python3.X >= 3.10 found (its version is unknown).
PY=""
for candidate in "${PYTHON:-}" python3 python python3.13 python3.12 python3.11 python3.10; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        PY="$candidate"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "run_on_gpu.sh: no Python >= 3.10 found" >&2
    exit 2
fi
echo "run_on_gpu.sh: using $PY ($("$PY" -c 'import platform; print(platform.python_version())'))" >&2

DRY_RUN=0
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && DRY_RUN=1
done

BUNDLE=build/gpu-bundle
PIP="not run"
if [ "$DRY_RUN" = 1 ]; then
    PIP="skipped (dry run)"
elif [ ! -f "$BUNDLE/requirements.txt" ]; then
    PIP="no bundle at $BUNDLE (run make gpu-bundle before carrying the tree)"
else
    pip_install() {
        "$PY" -m pip install -q --no-index --find-links "$BUNDLE/wheels" -r "$BUNDLE/requirements.txt" "$@" 2>&1 | tail -5
        return "${PIPESTATUS[0]}"
    }
    # A system Python may refuse (PEP 668): then again with --break-system-packages.
    if pip_install >&2 || pip_install --break-system-packages >&2; then
        PIP="ok"
    else
        PIP="failed"
    fi
fi
echo "run_on_gpu.sh: wheel install: $PIP" >&2

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" tests/gpu/gpu_run.py --pip "$PIP" "$@"
