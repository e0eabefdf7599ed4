"""Supervisor <-> actors: the start-up handshake, liveness and shutdown."""

from __future__ import annotations

import msgspec

from .common import PROTOCOL_VERSION


class Ready(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Sent once by each actor when it can take work. The Worker reports its KV cache size."""

    actor: str
    pid: int
    protocol_version: int = PROTOCOL_VERSION
    num_kv_blocks: int = 0


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    actor: str
    pid: int


class ActorError(msgspec.Struct, tag=True, array_like=True):
    """An actor hit a message it could not decode or handle; it keeps running."""

    actor: str
    message: str


class Stop(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    reason: str = ""


class ActorStatus(msgspec.Struct, omit_defaults=True):
    name: str
    pid: int
    state: str  # starting | ready | exited
    restarts: int = 0
    heartbeat_age_s: float = 0.0


class Roster(msgspec.Struct, tag=True, array_like=True):
    """The supervisor's view of its actors, pushed to the Engine for health replies."""

    actors: list[ActorStatus]


ToSupervisor = Ready | Heartbeat | ActorError
