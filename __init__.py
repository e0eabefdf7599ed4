"""actorserve: vLLM's design as an asyncio actor microkernel over ZeroMQ.

Doors: `LLM` (offline), `Client` / `AsyncClient` (ZeroMQ SDK), the `actorserve` CLI.
"""

from .gateway.client import AsyncClient, Client
from .gateway.errors import EngineError
from .messages.common import FinishReason, SamplingParams
from .offline import LLM, Completion, Sample

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
