#!/usr/bin/env bash
# Create .venv (if missing) and install ddprun with its test tools, torch pinned to the CPU build
# (constraints/dev.txt) so no multi-GB CUDA build is downloaded. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q -c constraints/dev.txt torch==2.13.0 -e ".[test,lint,lightning,report,ray,gpu]" 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, ddprun; print(f'ddprun {ddprun.__version__} with torch {torch.__version__}')"
