"""One codec: msgpack via msgspec, a typed decoder per inbox. No pickle anywhere."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from .blocks import AllocateStep, Allocation, FreeBlocks
from .client import ClientToEngine, EngineToClient
from .control import (
    Drain,
    Recover,
    ReplicaLost,
    ReplicaMoved,
    Reset,
    Roster,
    Stop,
    ToSupervisor,
)
from .step import AbortRequests, AddRequest, StatsQuery, StatsReply, StepPlan, StepResult, TokensOut
from .structured import CompileGrammar, GrammarReady

T = TypeVar("T")

EngineInbox = TokensOut | StatsReply | Roster | Recover | Drain | Stop
SchedulerInbox = (
    AddRequest | AbortRequests | Allocation | StepResult | StatsQuery | GrammarReady | Reset | Stop
)
BlockManagerInbox = AllocateStep | FreeBlocks | StatsQuery | Reset | Stop
WorkerInbox = Stop
# the HTTP gateway's process (a supervised child, not an actor)
GatewayInbox = Drain | ReplicaLost | ReplicaMoved | Stop
# read by the Worker's forward thread (WORKER_STEPS)
WorkerStepsInbox = StepPlan | CompileGrammar | Reset | Stop
SupervisorInbox = ToSupervisor

DecodeError = (msgspec.DecodeError, msgspec.ValidationError)

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class Decoder(Generic[T]):
    """Decodes one inbox's messages; raises one of `DecodeError` on any bytes it cannot take.

    msgspec raises other exceptions on some hostile bytes (RecursionError on deeply nested
    arrays); they are raised as DecodeError too, so a reader's one `except DecodeError` covers
    every input."""

    def __init__(self, inbox: Any):
        self._decoder = msgspec.msgpack.Decoder(inbox)

    def decode(self, data: bytes) -> T:
        try:
            return self._decoder.decode(data)
        except DecodeError:
            raise
        except Exception as exc:
            raise msgspec.DecodeError(f"{type(exc).__name__}: {exc}") from None


def peek_request_id(data: bytes) -> str | None:
    """Best effort: the `request_id` of an undecodable client message, to address the error.
    Never raises, whatever the bytes."""
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:
        return None
    if isinstance(raw, dict) and isinstance(raw.get("request_id"), str):
        return raw["request_id"]
    return None


__all__ = [
    "BlockManagerInbox",
    "ClientToEngine",
    "DecodeError",
    "Decoder",
    "EngineInbox",
    "EngineToClient",
    "GatewayInbox",
    "SchedulerInbox",
    "SupervisorInbox",
    "WorkerInbox",
    "WorkerStepsInbox",
    "encode",
    "peek_request_id",
]
