"""The Actor base every process shares: mailbox, peers, dispatch, Ready, Heartbeat, stop.

An actor binds one PULL socket (its mailbox) and PUSHes to its peers' mailboxes. Each message is
decoded with the inbox's typed decoder and handed to `on_<snake_case_name>`; handlers run one at a
time, in arrival order. A message that cannot be decoded or whose handler raises is logged and
reported to the supervisor as `ActorError` (a flood of them: the first, then a count a second);
the actor keeps running. A read loop yields to the event loop every `YIELD_EVERY` messages, so
a flood cannot starve the heartbeat; a read loop that ends anyway (a bug) ends the process with
a non-zero code, and the supervisor restarts it, never leaving a deaf actor that still beats.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import inspect
import itertools
import logging
import os
import re
import signal
import sys
import time
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec
import zmq

from ...messages.codec import DecodeError, Decoder, encode
from ...messages.control import ActorError, Heartbeat, Ready, Stop
from .config import EngineConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
YIELD_EVERY = 64  # messages a read loop takes without giving the event loop a turn
READ_LOOP_DIED = 70  # exit code of an actor whose read loop ended (EX_SOFTWARE)


class ErrorThrottle:
    """Says whether to report an error now: the first at once, then at most one report per
    `interval_s`, carrying how many were held back (a flood of bad messages must neither fill
    the log nor flood the supervisor's mailbox)."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.held = 0
        self._last = float("-inf")

    def take(self) -> int | None:
        """None: hold this one back; else the number held back since the last report."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self.held += 1
            return None
        self._last, held, self.held = now, self.held, 0
        return held


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)


def handler_name(message_type: type) -> str:
    return "on_" + re.sub(r"(?<!^)(?=[A-Z])", "_", message_type.__name__).lower()


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the supervisor) dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class LoopSocket:
    """A zmq socket driven by the event loop without pyzmq's asyncio futures (which cost a third
    of an actor's CPU per message): an actor's mailbox, the Engine's client ROUTER.

    The loop watches the socket's ZMQ_FD, which is edge-triggered: it signals that ZMQ_EVENTS
    may have changed, not that a message is waiting. So a reader takes a message whenever
    ZMQ_EVENTS says one is queued, and sleeps only after ZMQ_EVENTS, read after the wake-up flag
    was cleared, says none is: a message arriving after that read signals the FD again. A send on
    the same socket may consume the edge of a message that arrived meanwhile, so `send_multipart`
    reads ZMQ_EVENTS after it and wakes the reader itself.
    """

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self._readable = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _wait_readable(self) -> None:
        socket = self.socket
        while not socket.getsockopt(_EVENTS) & _POLLIN:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._loop.add_reader(socket.getsockopt(zmq.FD), self._on_fd)
            self._readable.clear()
            if not socket.getsockopt(_EVENTS) & _POLLIN:
                await self._readable.wait()

    def _on_fd(self) -> None:
        """The FD stays readable until zmq processes the socket's commands; reading ZMQ_EVENTS
        here does that, so the loop (level-triggered) does not call back on every turn while
        the reader is busy elsewhere."""
        if self.socket.getsockopt(_EVENTS) & _POLLIN:
            self._readable.set()

    async def receive(self) -> bytes:
        await self._wait_readable()
        return self.socket.recv(_NOBLOCK)

    async def receive_multipart(self) -> list[bytes]:
        await self._wait_readable()
        return self.socket.recv_multipart(_NOBLOCK)

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        """Send now (a ROUTER never blocks; with ROUTER_MANDATORY it raises zmq.Again where the
        peer's queue is full and EHOSTUNREACH where the peer is gone, instead of dropping)."""
        try:
            self.socket.send_multipart(frames, flags)
        finally:
            if self.socket.getsockopt(_EVENTS) & _POLLIN:
                self._readable.set()

    def close(self, linger: int = 0) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.socket.getsockopt(zmq.FD))
        self.socket.close(linger=linger)


_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # no enum ops


class Actor:
    name: ClassVar[str]
    inbox: ClassVar[Any]  # the Union of message types this actor accepts

    def __init__(self, config: EngineConfig):
        self.config = config
        self.addresses = config.addresses
        self.log = logging.getLogger(self.name)
        self.ctx = zmq.Context()  # sockets read through LoopSocket, not pyzmq's asyncio
        self._decoder = Decoder(self.inbox)
        self._handlers = {}
        for message_type in typing.get_args(self.inbox) or (self.inbox,):
            method = getattr(self, handler_name(message_type))
            self._handlers[message_type] = (method, inspect.iscoroutinefunction(method))
        self._outboxes: dict[str, zmq.Socket] = {}
        self._stopped = asyncio.Event()
        self._parent_pid = os.getppid()
        self._error_throttle = ErrorThrottle()
        self.exit_code = 0

    # -- hooks -------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Load what the actor needs before it says Ready (the Worker loads the model here)."""

    def ready(self) -> Ready:
        return Ready(actor=self.name, pid=os.getpid())

    async def background(self) -> None:
        """Extra long-running work beside the mailbox (the Engine serves its client socket)."""

    async def teardown(self) -> None:
        """Release resources after the mailbox stops."""

    # -- sending -----------------------------------------------------------------------------

    def send(self, peer: str, message: msgspec.Struct) -> None:
        """Queue a message for a peer's mailbox (never blocks: the send queue is unbounded)."""
        socket = self._outboxes.get(peer)
        if socket is None:
            socket = self._outboxes[peer] = self._connect(peer)
        socket.send(encode(message), copy=False)

    def _connect(self, peer: str) -> zmq.Socket:
        socket = self.ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 2000)
        socket.connect(self.addresses.mailbox(peer))
        return socket

    def report_error(self, message: str) -> None:
        held = self._error_throttle.take()
        if held is None:
            return
        if held:
            message = f"{message} (and {held} more errors in the last second, not logged)"
        self.log.error(message)
        self.send("supervisor", ActorError(actor=self.name, pid=os.getpid(), message=message))

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        socket = self.ctx.socket(zmq.PULL)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.bind(self.addresses.mailbox(self.name))
        mailbox = LoopSocket(socket)
        try:
            await self.setup()
            self.send("supervisor", self.ready())
            tasks = [
                asyncio.create_task(self._serve(mailbox), name="mailbox"),
                asyncio.create_task(self._heartbeat(), name="heartbeat"),
                asyncio.create_task(self.background(), name="background"),
            ]
            stopped = asyncio.create_task(self._stopped.wait())
            waiting = {stopped, *tasks}
            while stopped in waiting:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if self._ended_early(done - {stopped}):
                    break
            for task in [stopped, *tasks]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.teardown()
        finally:
            mailbox.close()
            for socket in self._outboxes.values():
                socket.close()
            self.ctx.term()

    def request_stop(self) -> None:
        self._stopped.set()

    def _ended_early(self, tasks: set[asyncio.Task]) -> bool:
        """Whether one of these tasks, ended before Stop, leaves the actor deaf or mute (the
        mailbox's or the client socket's read loop, the heartbeat): then it exits non-zero, and
        the supervisor restarts it. `background` may return at once (most actors have none)."""
        if self._stopped.is_set():
            return False
        for task in tasks:
            error = None if task.cancelled() else task.exception()
            if task.get_name() == "background" and error is None and not task.cancelled():
                continue
            self.log.error(
                "the %s task ended (%s): exiting for a restart",
                task.get_name(),
                f"{type(error).__name__}: {error}" if error else "returned",
                exc_info=error,
            )
            self.exit_code = READ_LOOP_DIED
            return True
        return False

    def _on_sigterm(self) -> None:
        """SIGTERM stops an actor whose supervisor is gone (PR_SET_PDEATHSIG sends it then).
        While the supervisor lives, stopping is its call: a SIGTERM sent to the whole process
        group or cgroup (`timeout`, `kill -- -PGID`, systemd's default KillMode) reaches it
        too, and it drains the requests in flight before it sends each actor Stop; an actor
        that quit at once would drop them, and be restarted mid-drain."""
        if os.getppid() != self._parent_pid:
            self.request_stop()
        else:
            self.log.info("SIGTERM: left to the supervisor, which drains, then stops the actors")

    async def on_stop(self, message: Stop) -> None:
        self.log.info("stopping%s", f": {message.reason}" if message.reason else "")
        self.request_stop()

    async def _serve(self, mailbox: LoopSocket) -> None:
        for count in itertools.count(1):
            await self.dispatch(await mailbox.receive())
            if count % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # messages queued: receive() did not suspend

    async def dispatch(self, data: bytes) -> None:
        try:
            message = self._decoder.decode(data)
        except DecodeError as exc:
            self.report_error(f"could not decode a {len(data)}-byte message: {exc}")
            return
        handler, is_async = self._handlers[type(message)]
        try:
            if is_async:
                await handler(message)
            else:
                handler(message)
        except Exception as exc:  # a bad message must never kill the actor
            self.log.exception("handler for %s failed", type(message).__name__)
            self.report_error(f"{type(message).__name__} failed: {type(exc).__name__}: {exc}")

    async def _heartbeat(self) -> None:
        beat = Heartbeat(actor=self.name, pid=os.getpid())
        while True:
            self.send("supervisor", beat)
            if os.getppid() != self._parent_pid:
                self.log.error("supervisor is gone; stopping")
                self.request_stop()
            await asyncio.sleep(self.config.heartbeat_interval_s)


def actor_main(actor_cls: type[Actor], config_json: str) -> None:
    """Process entry of an actor whose argument is its config as JSON."""
    run_actor(lambda: actor_cls(EngineConfig.from_json(config_json)))


def run_actor(make: Callable[[], Actor]) -> None:
    """Process entry: logging, signals, uvloop, `make()` the actor and run it until stopped;
    exit with its code (exit_without_finalizing)."""
    configure_logging()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the supervisor, which stops us
    actor = make()
    try:
        import uvloop

        uvloop.run(actor.run())
    except ImportError:
        asyncio.run(actor.run())
    exit_without_finalizing(actor.exit_code)


def exit_without_finalizing(code: int) -> None:
    """Exit once the actor's own stop is done (sockets closed, context terminated, so every
    message queued has been sent): atexit handlers run (a step trace writes its file, logging
    flushes), then the process ends without the interpreter's finalization, which frees every
    module's objects one by one (torch's and transformers' are many) and holds an actor that
    has nothing left to do for a second of CPU on every stop; the supervisor stops its actors
    one after another, so that second is paid per actor. (An exception out of `run` still exits
    the usual way, with its traceback.)"""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
