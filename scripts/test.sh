#!/usr/bin/env bash
# Set up (idempotent), build the test checkpoints (cached), run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium for the playground test (Debian's package; needs root, as in CI).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
        || echo "warning: could not install chromium; the playground test will fail (it skips only outside CI)" >&2
fi
. .venv/bin/activate
ruff check .
# Ends with the 30 slowest tests and the time per test file (tests/file_times.py): the suite's
# budget is 15 minutes on a 2-core machine, slow tests included.
exec python -m pytest -q -ra --durations=30 "$@"
