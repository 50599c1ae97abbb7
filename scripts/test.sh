#!/usr/bin/env bash
# The test suite on a fresh machine: set up .venv, then pytest (every test bounded by pytest-timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
export OMP_NUM_THREADS=1
export DDPRUN_TESTS_NEED_EXTRAS=1  # setup-env.sh installed every extra: a failing import fails, never skips
# two tests at a time (tests/conftest.py: which ones run alone); -n 0 after it runs them one by one
exec .venv/bin/python -m pytest -n "${DDPRUN_TEST_WORKERS:-2}" --dist loadgroup "$@"
