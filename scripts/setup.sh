#!/usr/bin/env bash
# Idempotent set-up: .venv, the CPU torch wheel first (a bare `torch` would pull a CUDA build),
# then the project in editable mode with its dev, bench (matplotlib) and ray (the Ray placement's
# tests) extras. Fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
stamp=.venv/.actorserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
    pip install -q --upgrade pip >/dev/null 2>&1 || true
    pip install -q -e '.[dev,bench,ray]'
    touch "$stamp"
fi
# The CPU kernels in C (kernels/cpu/csrc/*.c) are built on first use with the machine's C compiler;
# without one the engine falls back to torch (slower) and the kernel tests fail.
if ! command -v cc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq gcc >/dev/null
fi
python -c "from actorserve.kernels.cpu import bindings; bindings.load() or print('no C kernels: plain torch')"
