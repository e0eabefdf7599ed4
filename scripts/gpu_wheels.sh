#!/usr/bin/env bash
# The wheels scripts/gpu_check.py installs on the GPU machine, which reaches no registry. Its image
# brings torch, triton, transformers, tokenizers, safetensors, numpy, tqdm, uvloop, anyio, h11,
# click, prometheus-client, pytest, pytest-timeout and hypothesis; the rest of what the engine,
# its gateway and the gpu-marked tests import is downloaded here, at the versions this venv runs
# (scripts/setup.sh), built for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored; name it in
# the device run's `carry`).
#
#     bash scripts/gpu_wheels.sh [DEST]        # default .whl
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYTHON_VERSION=3.12
# runtime: msgspec, pyzmq, xgrammar (+ apache-tvm-ffi, pydantic); the gateway: fastapi, starlette,
# uvicorn, websockets; tests: pytest-asyncio (pyproject's asyncio_mode), jsonschema's absence is
# fine (only the structured-output tests import it, none gpu-marked)
NAMES=(
    msgspec pyzmq xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types
    typing-inspection typing_extensions fastapi annotated-doc starlette uvicorn websockets
    opentelemetry-api pytest-asyncio
)
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
pins=()
for name in "${NAMES[@]}"; do
    version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
        "$name" 2>/dev/null) || { echo "gpu_wheels: $name is not installed here" >&2; exit 1; }
    pins+=("$name==$version")
done
mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp "${platforms[@]}" -d "$DEST" "${pins[@]}"
du -sh "$DEST"
ls "$DEST"
