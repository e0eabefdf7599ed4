#!/usr/bin/env bash
# Set up (idempotent), build the test checkpoints (cached), run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
exec python -m pytest -q -ra "$@"
