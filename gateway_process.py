"""The HTTP/WebSocket gateway as a process of its own, supervised like an actor.

Inbox (its mailbox, from the supervisor): Drain (answer 503 to new requests), Stop (let the
responses in flight finish, up to `grace_s`, then exit 0).
Outbox: Ready once it serves, Heartbeat every interval, Drained once it refuses new requests
-> supervisor.
Owns: the HTTP server on a listening socket it inherits (the supervisor keeps it open, so a
restarted gateway serves on the same port and no connection is refused meanwhile), its SDK
client to the Engine, the chat template.
Dies when: Stop, its supervisor goes away, or its server stops by itself (then non-zero, and
the supervisor restarts it). A stall or an OOM here no longer touches supervision: the
supervisor's event loop runs nothing of the gateway's. When it dies, the Engine aborts its
requests (its client identity is gone) and its clients see their connections close.

This module wires the actors' runtime and the gateway together, as cli.py does (the gateway
package itself imports only messages).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

import msgspec
import zmq

from .actors.runtime import LoopSocket, configure_logging, die_with_parent
from .gateway.server import HTTPGateway
from .gateway.service import GatewaySettings
from .messages.codec import DecodeError, Decoder, GatewayInbox, encode
from .messages.control import Drain, Drained, Heartbeat, Ready, Stop

NAME = "gateway"
log = logging.getLogger(NAME)


class GatewaySpec(msgspec.Struct, frozen=True):
    """What the serving process hands its gateway child (a JSON file, the path its argument)."""

    settings: GatewaySettings
    engine_address: str
    supervisor_mailbox: str
    mailbox: str
    heartbeat_interval_s: float
    listen_fd: int  # the listening socket, inherited
    host: str
    port: int
    client_options: dict[str, str | list[str]] = {}  # the SDK's CurveZMQ keys, if any
    grace_s: float = 5.0


async def serve(spec: GatewaySpec) -> int:
    parent = os.getppid()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, _sigterm, parent)
    sock = socket.socket(fileno=spec.listen_fd)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.client_options.items()}
    gateway = HTTPGateway(spec.engine_address, spec.settings, spec.host, spec.port, options)
    gateway.prepare(sock)
    await gateway.start()
    ctx = zmq.Context()
    supervisor = ctx.socket(zmq.PUSH)
    supervisor.setsockopt(zmq.LINGER, 1000)
    supervisor.connect(spec.supervisor_mailbox)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(spec.mailbox)
    mailbox = LoopSocket(inbox)
    supervisor.send(encode(Ready(actor=NAME, pid=os.getpid())))
    beat = loop.create_task(heartbeat(supervisor, spec.heartbeat_interval_s, parent))
    read = loop.create_task(read_mailbox(mailbox, gateway, supervisor))
    try:
        done, _ = await asyncio.wait(
            [read, beat, gateway.task], return_when=asyncio.FIRST_COMPLETED
        )
        stopped = read in done and read.exception() is None
        if not stopped:
            log.error("the gateway's %s ended: exiting for a restart", _which(done, gateway))
        await gateway.stop(spec.grace_s if stopped else 0)
        return 0 if stopped else 1
    finally:
        beat.cancel()
        read.cancel()
        mailbox.close()
        supervisor.close()
        ctx.term()


async def read_mailbox(mailbox: LoopSocket, gateway: HTTPGateway, supervisor: zmq.Socket) -> None:
    """Until Stop (or the supervisor goes away): Drain makes the gateway refuse new requests,
    and it says so (Drained), before the supervisor drains the Engine."""
    decoder = Decoder(GatewayInbox)
    while True:
        data = await mailbox.receive()
        try:
            message = decoder.decode(data)
        except DecodeError as exc:
            log.error("could not decode a %d-byte message: %s", len(data), exc)
            continue
        if isinstance(message, Drain):
            log.info("draining: new requests get 503")
            gateway.refuse_new()
            supervisor.send(encode(Drained(actor=NAME, pid=os.getpid())))
        elif isinstance(message, Stop):
            log.info("stopping%s", f": {message.reason}" if message.reason else "")
            return


async def heartbeat(supervisor: zmq.Socket, interval_s: float, parent: int) -> None:
    beat = encode(Heartbeat(actor=NAME, pid=os.getpid()))
    while os.getppid() == parent:
        supervisor.send(beat)
        await asyncio.sleep(interval_s)
    log.error("supervisor is gone; stopping")


def _which(done: set[asyncio.Task], gateway: HTTPGateway) -> str:
    if gateway.task in done:
        return "HTTP server"
    return "supervisor link" if len(done) == 1 else "mailbox"


def _sigterm(parent: int) -> None:
    """As an actor: a SIGTERM to the whole process group is the supervisor's to handle (it
    drains first, then sends Stop); once the supervisor is gone the heartbeat task ends."""
    log.info("SIGTERM: left to the supervisor")


def main(spec_path: str) -> int:
    configure_logging()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the supervisor, which stops us
    with open(spec_path, "rb") as f:
        spec = msgspec.json.decode(f.read(), type=GatewaySpec)
    try:
        import uvloop

        return uvloop.run(serve(spec))
    except ImportError:
        return asyncio.run(serve(spec))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
