"""actorserve: vLLM's design as an asyncio actor microkernel over ZeroMQ.

Doors: `LLM` (offline), `Client` / `AsyncClient` (ZeroMQ SDK), the `actorserve` CLI.
"""

# Absolute imports: pytest imports this file as a plain module when it collects the checkout
# (the repository root is the package), whatever the checkout's directory is called.
from actorserve.gateway.client import AsyncClient, Client
from actorserve.gateway.errors import EngineError
from actorserve.messages.common import FinishReason, SamplingParams
from actorserve.offline import LLM, Completion, Sample

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
