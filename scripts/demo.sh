#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then 2 simulated nodes x 2 processes (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/ddprun demo "$@"
