#!/usr/bin/env bash
# The layers' keepers: ruff (lint, import order) and mypy (types) over the sources, both clean.
# The import-graph and function-length rules are tests (tests/unit/test_layers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
.venv/bin/ruff check src tests benchmarks scripts examples
.venv/bin/mypy
