#!/usr/bin/env bash
# The GPU check: tests marked gpu, a benchmark against TRL, one JSON of results (scripts/gpu_check.py says what, and
# docs/performance.md 6 what it measured).
#   bash scripts/gpu_check.sh --prepare     # first, on a machine with the project installed: tokenizer + wheels -> .gpu/
#   bash scripts/gpu_check.sh [--out DIR]   # on the GPU machine (PyTorch with CUDA, transformers, accelerate, peft)
#   bash scripts/gpu_check.sh --dry-run     # the same steps on a CPU, tiny shapes (a test runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ " $* " != *" --prepare "* && " $* " != *" --dry-run "* && -d .gpu/wheels ]]; then
    # the packages the GPU image lacks, carried as wheels (no network there); installed beside it, not over it
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/agrpo-site \
        .gpu/wheels/*.whl
    export PYTHONPATH=/tmp/agrpo-site${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
