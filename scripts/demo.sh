#!/usr/bin/env bash
# Set up (idempotent) and serve the trained demo checkpoint (weights/demo-python, committed; made
# by scripts/train_demo.py): the four actor processes behind the ZeroMQ SDK address and the HTTP
# gateway (OpenAI routes, WebSocket, playground at /).
# Ctrl-C or SIGTERM drains and stops. HOST / PORT override where HTTP listens.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
model=$(python -m actorserve.weights.checkpoints demo-python)
host=${HOST:-127.0.0.1}
port=${PORT:-8000}
cat >&2 <<MSG
Serving the demo checkpoint (a small Llama trained on permissively licensed Python). Try, from
another shell:
  open http://$host:$port/  (the playground)
  curl -s http://$host:$port/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "demo-python", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0,
            "repetition_penalty": 1.3}'
  .venv/bin/actorserve generate --address ipc://$PWD/.run/demo.sock --prompt "class Stack:"
MSG
mkdir -p .run
exec actorserve serve --model "$model" --host "$host" --port "$port" \
    --address "ipc://$PWD/.run/demo.sock" "$@"
