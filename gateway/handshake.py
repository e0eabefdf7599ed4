"""Whether an SDK socket's CurveZMQ handshakes with its engine fail, from the socket's monitor.

A DEALER whose handshake the engine refuses hears nothing: its requests queue, or wait for a
connection that never comes, until a liveness timeout. The monitor says at once, and why:
HANDSHAKE_FAILED_AUTH is the engine's authenticator refusing this client's key (it is not in
the engine's authorized clients); HANDSHAKE_FAILED_NO_DETAIL / _PROTOCOL is a handshake that
could not complete (the server's public key we have is not the engine's, or one side speaks
CURVE and the other does not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused this client's CurveZMQ key (not among its "
    "authorized clients)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed the CurveZMQ handshake (is the server's "
    "public key given for it its own? does it serve with CurveZMQ?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed the CurveZMQ handshake (protocol error: does "
    "it serve with CurveZMQ?)",
}
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
for _event in FAILED:
    EVENTS |= _event


class HandshakeWatch:
    """Reads `socket`'s monitor (made here: call before connect) in a task started by `start`;
    `on_failure(reason)` on each failed handshake. `refused` holds the last failure's reason
    until a handshake succeeds."""

    def __init__(self, socket: zmq.asyncio.Socket, on_failure: Callable[[str], None]):
        self.monitor = socket.get_monitor_socket(EVENTS)
        self.on_failure = on_failure
        self.refused: str | None = None
        self.failed = asyncio.Event()  # set while `refused` holds a reason
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.retry()
            elif event in FAILED:
                self.refused = FAILED[event]
                self.failed.set()
                self.on_failure(self.refused)

    def retry(self) -> None:
        """Forget the last failure (a new handshake is under way, or one succeeded)."""
        self.refused = None
        self.failed.clear()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        self.monitor.close(linger=0)
