"""The HTTP/WebSocket gateway as a process of its own, supervised like an actor (it is one).

Inbox (its mailbox, from the supervisor): Drain (answer 503 to new requests, then say Drained),
Stop (let the responses in flight finish, up to `grace_s`, then exit 0); from the serving
process, ReplicaLost and ReplicaMoved (a replica's placement lost it, then restarted it at
another address).
Outbox: Ready once it serves, Heartbeat, Drained -> supervisor.
Owns: the HTTP server on a listening socket it inherits (the serving process keeps it open, so a
restarted gateway serves on the same port), its SDK clients to the Engine (one per data-parallel
replica: settings.replicas, gateway/replicas.py), its subscriptions to their KV events and the
index of each replica's prefix cache built from them (kv_events.py, kv_index.py), the chat
template.
Dies when: Stop, its supervisor goes away, or its server stops by itself (then non-zero, and the
supervisor restarts it). A stall or an OOM here no longer touches supervision: the supervisor's
event loop runs nothing of the gateway's. When it dies, the Engine aborts its requests (its
client identity is gone) and its clients see their connections close.

This module wires the actors' runtime and the gateway together, as cli/main.py does (the gateway
package itself imports only messages).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import msgspec

from ..actors.runtime.actor import Actor, run_actor
from ..actors.runtime.config import EngineConfig
from ..messages.codec import GatewayInbox
from ..messages.control import Drain, Drained, ReplicaLost, ReplicaMoved
from .curve_keys import ClientKeys
from .server import HTTPGateway
from .service import GatewaySettings

NAME = "gateway"


class GatewaySpec(msgspec.Struct, frozen=True):
    """What the serving process hands its gateway child (a JSON file, the path its argument)."""

    config: EngineConfig  # the engine's: addresses, heartbeat interval
    settings: GatewaySettings
    listen_fd: int  # the listening socket, inherited
    host: str
    port: int
    # the CurveZMQ keys of each engine it talks to (settings.replicas, else config's), by position
    engine_keys: list[ClientKeys | None] = []
    grace_s: float = 5.0


class Gateway(Actor):
    name = NAME
    inbox = GatewayInbox

    def __init__(self, spec: GatewaySpec):
        super().__init__(spec.config)
        self.spec = spec

    async def setup(self) -> None:
        spec = self.spec
        self.http = HTTPGateway(
            self.addresses.client, spec.settings, spec.host, spec.port, spec.engine_keys
        )
        self.http.prepare(socket.socket(fileno=spec.listen_fd))
        await self.http.start()

    async def background(self) -> None:
        """The HTTP server: its end before Stop ends the process for a restart. (Shielded: on
        Stop this task is cancelled, and teardown stops the server gracefully.)"""
        await asyncio.shield(self.http.task)
        raise RuntimeError("the HTTP server stopped")

    def on_drain(self, message: Drain) -> None:
        self.log.info("draining: new requests get 503")
        self.http.refuse_new()
        self.send("supervisor", Drained(NAME, os.getpid()))

    def on_replica_lost(self, message: ReplicaLost) -> None:
        if self._replica_known(message.index):
            self.log.warning("replica %d is lost: %s", message.index, message.reason)
            self.http.lose_replica(message.index, message.reason)

    def on_replica_moved(self, message: ReplicaMoved) -> None:
        if self._replica_known(message.index):
            self.log.warning("replica %d now serves at %s", message.index, message.address)
            self.http.move_replica(message.index, message.address)

    def _replica_known(self, index: int) -> bool:
        count = len(self.spec.settings.replicas)
        if not 0 <= index < count:
            self.report_error(f"no replica {index}: the gateway routes across {count}")
        return 0 <= index < count

    async def teardown(self) -> None:
        await self.http.stop(self.spec.grace_s if self.exit_code == 0 else 0)


def main(spec_path: str) -> None:
    with open(spec_path, "rb") as f:
        spec = msgspec.json.decode(f.read(), type=GatewaySpec)
    run_actor(lambda: Gateway(spec))


if __name__ == "__main__":
    main(sys.argv[1])
