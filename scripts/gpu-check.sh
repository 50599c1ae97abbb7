#!/usr/bin/env bash
# The CUDA path end to end on one GPU (< 10 minutes), summary in gpu-check.json (scripts/gpu_check.py).
#   ./scripts/gpu-check.sh               on a GPU machine
#   ./scripts/gpu-check.sh --dry-run     anywhere: the CUDA steps are skipped, each with the reason
# Python: $PYTHON, else .venv (scripts/setup-env.sh), else python3 on PATH; extra flags go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
PY=${PYTHON:-$PY}
exec timeout 600 "$PY" scripts/gpu_check.py "$@"
