"""actorserve: vLLM's design as an asyncio actor microkernel over ZeroMQ.

Doors: `LLM` (offline), `Client` / `AsyncClient` (ZeroMQ SDK), the `actorserve` CLI.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING


def _leave_sys_path() -> None:
    """Take this package's own directory off sys.path. It is the repository root (pyproject maps
    actorserve to "."), and it gets there as the current directory of `python -m ...` or
    `python -m pytest` run in a checkout, as every actor process is. There its folders would
    be top-level modules shadowing installed ones of the same name: transformers imports the
    PyPI `kernels` package, and would find actorserve's kernels/ instead. Every module of the
    package is reached as actorserve.X, so nothing needs the directory on the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]


_leave_sys_path()

# Imported on first use (PEP 562): every actor process imports this package before its own
# module, and none of them needs the SDK or the offline API; their imports would cost each
# start and restart. Absolute names: pytest imports this file as a plain module when it
# collects the checkout (the repository root is the package), whatever its directory is called.
_EXPORTS = {
    "AsyncClient": "actorserve.gateway.client",
    "Client": "actorserve.gateway.blocking_client",
    "EngineError": "actorserve.gateway.errors",
    "FinishReason": "actorserve.messages.common",
    "SamplingParams": "actorserve.messages.common",
    "LLM": "actorserve.offline",
    "Completion": "actorserve.offline",
    "Sample": "actorserve.offline",
}

__all__ = [
    "LLM",
    "AsyncClient",
    "Client",
    "Completion",
    "Sample",
    "EngineError",
    "FinishReason",
    "SamplingParams",
]

if TYPE_CHECKING:
    from actorserve.gateway.blocking_client import Client
    from actorserve.gateway.client import AsyncClient
    from actorserve.gateway.errors import EngineError
    from actorserve.messages.common import FinishReason, SamplingParams
    from actorserve.offline import LLM, Completion, Sample


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
