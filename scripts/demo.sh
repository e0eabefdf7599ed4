#!/usr/bin/env bash
# Set up (idempotent), build the demo checkpoint (cached) and stream a completion from it
# through the four actor processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
model=$(python -m actorserve.checkpoints demo)
exec actorserve generate --model "$model" --prompt "${PROMPT:-def fibonacci(n):}" \
    --max-tokens "${MAX_TOKENS:-128}" --ignore-eos "$@"
