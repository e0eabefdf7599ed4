"""Supervisor <-> actors: the start-up handshake, liveness and shutdown."""

from __future__ import annotations

import msgspec

from .common import PROTOCOL_VERSION


class Ready(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Sent once by each actor when it can take work. The Worker reports its KV cache size and
    the device type it serves on ("cuda", "cpu"), which settings' defaults depend on."""

    actor: str
    pid: int
    protocol_version: int = PROTOCOL_VERSION
    num_kv_blocks: int = 0
    num_cpu_blocks: int = 0
    device: str = ""


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    actor: str
    pid: int


class ActorError(msgspec.Struct, tag=True, array_like=True):
    """An actor hit a message it could not decode or handle; it keeps running."""

    actor: str
    pid: int
    message: str


class Stop(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    reason: str = ""


class ActorStatus(msgspec.Struct, omit_defaults=True):
    """One supervised process as a health reply shows it, its ages as of that reply."""

    name: str
    pid: int  # while restarting: the process that died
    state: str  # starting | ready | restarting | exited
    restarts: int = 0
    heartbeat_age_s: float = 0.0  # since the supervisor last heard it (at most one roster late)
    last_recovery_s: float = 0.0  # death noticed -> replacement Ready and state reset
    errors: int = 0  # messages it could not decode or handle (ActorError), since it started
    exit_code: int | None = None  # of its last death: its status, or -N for signal N
    state_age_s: float = 0.0  # in this state (restarting: since its death was noticed)


class RosterEntry(msgspec.Struct, array_like=True, omit_defaults=True):
    """One supervised process as the supervisor sends it to the Engine: instants, not ages, so
    the Engine computes each age when it answers (a roster's ages would be frozen at its send).
    The instants are `time.monotonic()` of the supervisor's host, one clock for every process
    on it; the Engine is the supervisor's child, so it reads the same clock. (A client may be
    on another host: it gets ages, never these instants.)"""

    name: str
    pid: int
    state: str
    heartbeat_at: float  # the last heartbeat (restarting: the dead process's last)
    state_since: float
    restarts: int = 0
    last_recovery_s: float = 0.0
    errors: int = 0
    exit_code: int | None = None

    def status(self, now: float) -> ActorStatus:
        """As seen at `now` (the same clock's)."""
        return ActorStatus(
            self.name,
            self.pid,
            self.state,
            self.restarts,
            round(max(0.0, now - self.heartbeat_at), 3),
            round(self.last_recovery_s, 3),
            self.errors,
            self.exit_code,
            round(max(0.0, now - self.state_since), 3),
        )


class Reset(msgspec.Struct, tag=True, array_like=True):
    """Supervisor -> Scheduler after an actor restarted; the Scheduler clears its state and
    forwards it to the BlockManager and Worker (after anything it sent them before), then sends
    Recover to the Engine. Messages stamped with another epoch are dropped from then on.
    `actor`: the one that was restarted (the Engine counts each request's consecutive crashes
    of one actor: poison quarantine).
    """

    epoch: int
    actor: str = ""


class Recover(msgspec.Struct, tag=True, array_like=True):
    """Scheduler -> Engine, after every earlier TokensOut: re-submit each live request.
    `actor`: the one whose restart caused it (as in Reset)."""

    epoch: int
    actor: str = ""


class Drain(msgspec.Struct, tag=True, array_like=True):
    """Supervisor -> Engine: refuse new requests; say Drained once no request is live."""


class Drained(msgspec.Struct, tag=True, array_like=True):
    actor: str
    pid: int


class ReplicaLost(msgspec.Struct, tag=True, array_like=True):
    """Serving process -> gateway: data-parallel replica `index` is gone (`reason`: its
    placement says why). Its open streams go on on another replica at once, as resumptions,
    rather than after the engine liveness timeout; it takes no new requests until moved."""

    index: int
    reason: str


class ReplicaMoved(msgspec.Struct, tag=True, array_like=True):
    """Serving process -> gateway: data-parallel replica `index` now serves at `address` (its
    placement, cli/ray_placement.py, started a replacement elsewhere). Its streams still open on
    the old address go on on another replica as resumptions; the replacement takes new requests
    once it answers a health check. The CurveZMQ keys stay the replica's."""

    index: int
    address: str


class Roster(msgspec.Struct, tag=True, array_like=True):
    """The supervisor's view of its actors, pushed to the Engine for health replies: every
    heartbeat interval, and at once when one dies, is replaced or is Ready."""

    actors: list[RosterEntry]


ToSupervisor = Ready | Heartbeat | ActorError | Drained
