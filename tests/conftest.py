"""Shared fixtures: checkpoints built locally, engines started as real `actorserve serve` processes.

Triton runs in its interpreter on CPU-only machines (set before any import of triton).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from file_times import FileTimes  # noqa: E402

from actorserve.weights.checkpoints import ensure_checkpoint  # noqa: E402
from support import EngineServer  # noqa: E402


def pytest_configure(config):
    config.pluginmanager.register(FileTimes(), "file_times")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return ensure_checkpoint("tiny-llama")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return ensure_checkpoint("tiny-qwen3")


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    return ensure_checkpoint("demo")


@pytest.fixture(autouse=True)
def every_block_comes_back(request):
    """Spec 8: after every test, blocks free == blocks total on each engine it used."""
    yield
    for value in list(request.node.funcargs.values()):
        if isinstance(value, EngineServer) and value.proc.poll() is None:
            stats = value.wait_blocks_free()
            assert stats.blocks_free == stats.blocks_total, (
                f"{stats.blocks_total - stats.blocks_free} KV blocks leaked: {stats}"
            )
