#!/usr/bin/env bash
# The test suite on a fresh machine: set up .venv, then pytest (every test bounded by pytest-timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
export OMP_NUM_THREADS=1
export DDPRUN_TESTS_NEED_EXTRAS=1  # setup-env.sh installed every extra: a failing import fails, never skips
exec .venv/bin/python -m pytest "$@"
