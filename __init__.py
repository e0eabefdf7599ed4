"""actorserve: vLLM's design as an asyncio actor microkernel over ZeroMQ.

Doors: `LLM` (offline), `Client` / `AsyncClient` (ZeroMQ SDK), the `actorserve` CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported on first use (PEP 562): every actor process imports this package before its own
# module, and none of them needs the SDK or the offline API; their imports would cost each
# start and restart. Absolute names: pytest imports this file as a plain module when it
# collects the checkout (the repository root is the package), whatever its directory is called.
_EXPORTS = {
    "AsyncClient": "actorserve.gateway.client",
    "Client": "actorserve.gateway.client",
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
    from actorserve.gateway.client import AsyncClient, Client
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
