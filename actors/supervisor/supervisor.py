"""The supervisor: starts the four actor processes in order, watches them, stops them in order.

Start: Worker first (it measures the KV cache and reports num_kv_blocks and its device in Ready:
the defaults that depend on the device are resolved from it), then the BlockManager (sized from
that) and the Scheduler together, last the Engine (which opens the clients' door). The Engine and
the children are spawned with the Worker (they read nothing it measures); a request they take
before the Scheduler is up waits in its mailbox's queue. Each must send Ready within
`ready_timeout_s` of the start, awaited in that order, or start-up fails naming the actor.

While serving: an actor that exits, or misses 3 heartbeats (hung, SIGSTOPped: it is killed), is
restarted after an exponential backoff; the replacement starts at epoch -1 (deaf to stale
messages) and, once Ready, the supervisor sends Reset(epoch + 1) to the Scheduler, which clears
the step state everywhere and has the Engine re-submit its journal. More than `max_restarts`
deaths of one actor within `restart_window_s` stop the whole tree with the reason.
Drain: the Engine refuses new requests until in-flight ones finish (or `drain_timeout_s`).
Stop: Engine first (no new requests), then Scheduler, BlockManager, Worker.

Other children (`supervise`: the HTTP gateway) are watched and restarted the same way but hold
no step state: they stop and drain first, and their restart resets nothing. They speak the
actors' control protocol (Ready, Heartbeat; Drain, Stop). A tree may have no actors at all (the
gateway's own, cli/serve.py): it then only watches its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time

import msgspec
import zmq

from ...messages.codec import DecodeError, Decoder, SupervisorInbox, encode
from ...messages.common import PROTOCOL_VERSION
from ...messages.control import (
    ActorError,
    ActorStatus,
    Drain,
    Drained,
    Ready,
    Reset,
    Roster,
    Stop,
)
from ..runtime.actor import LoopSocket
from ..runtime.addresses import ACTORS, Addresses
from ..runtime.config import EngineConfig
from ..runtime.config_resolution import resolve_device, resolve_kv_blocks, resolve_model
from ..runtime.curve import check_curve
from .actor_process import MODULES, ActorProcess, Child, restart_delay

log = logging.getLogger("supervisor")

# Actors whose config reads no field the Worker's Ready resolves (device defaults, block counts):
# the Engine reads the checkpoint's facts and the request limits only.
INDEPENDENT_OF_WORKER = ("engine",)


class SupervisorError(RuntimeError):
    """The engine cannot serve: an actor failed to start or died."""


class Supervisor:
    def __init__(self, config: EngineConfig, client_address: str | None = None, actors=ACTORS):
        # () in a tree of the gateway alone (cli/serve.py)
        self.actor_names: tuple[str, ...] = actors
        config.validate()
        check_curve(config, client_address)  # tcp:// only with CURVE keys (or loopback, if asked)
        resolved = resolve_model(config)  # before the run directory: an error leaves none
        self.run_dir = tempfile.mkdtemp(prefix="actorserve-")  # mode 0700
        client_address = client_address or f"ipc://{self.run_dir}/client.sock"
        addresses = Addresses(self.run_dir, client_address)
        if resolved.kv_events and actors:
            try:
                addresses.kv_events()
            except ValueError as exc:  # no port beside the client's: serve on without events
                log.warning("kv_events off: %s", exc)
                resolved = msgspec.structs.replace(resolved, kv_events=False)
        self.config = msgspec.structs.replace(resolved, addresses=addresses)
        self.actors: dict[str, ActorProcess] = {}
        self.children: dict[str, Child] = {}  # by name
        self.failure: str | None = None
        self.epoch = self.config.epoch
        self._drained = asyncio.Event()  # the Engine's Drained
        self._children_drained: set[str] = set()
        self._child_drained = asyncio.Event()
        self._done = asyncio.Event()
        self._ready_changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._outboxes: dict[str, zmq.Socket] = {}
        self.ctx: zmq.Context | None = None  # made by start()
        self.mailbox: LoopSocket | None = None

    @property
    def client_address(self) -> str:
        return self.config.addresses.client

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.ctx = zmq.Context()  # sockets read through LoopSocket, not pyzmq's asyncio
        socket = self.ctx.socket(zmq.PULL)
        socket.bind(self.config.addresses.mailbox("supervisor"))
        self.mailbox = LoopSocket(socket)
        self._tasks.append(asyncio.create_task(self._receive()))
        try:
            # The Engine and the children load tokenizers while the Worker loads the model; the
            # BlockManager and Scheduler start together on its numbers. Ready: in start order.
            first = [a for a in ("worker", *INDEPENDENT_OF_WORKER) if a in self.actor_names]
            early = (*first, *self.children)
            for name in early:
                self._spawn(name)
            for name in (*self.actor_names, *self.children):
                ready = await self._wait_ready(name)
                if name == "worker":
                    self.config = resolve_kv_blocks(
                        resolve_device(self.config, ready.device),
                        ready.num_kv_blocks,
                        ready.num_cpu_blocks,
                    )
                    for later in (a for a in self.actor_names if a not in early):
                        self._spawn(later)
        except BaseException:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self._publish_roster()))
        self._tasks.append(asyncio.create_task(self._monitor()))
        log.info(
            "serving %s at %s (pids: %s)",
            self.config.model,
            self.client_address,
            ", ".join(f"{a.name}={a.process.pid}" for a in self.actors.values()),
        )

    def supervise(self, child: Child) -> None:
        """Start, watch and restart `child` too (call before start)."""
        self.children[child.name] = child

    def _spawn(self, name: str, restart: bool = False) -> None:
        child = self.children.get(name)
        if child is not None:
            command, pass_fds = [child.module, *child.args], child.pass_fds
        else:
            config = msgspec.structs.replace(self.config, epoch=-1) if restart else self.config
            command, pass_fds = [MODULES[name], config.to_json().decode()], ()
        self.actors[name] = ActorProcess.spawn(
            name, command, pass_fds, self.actors.get(name), self.config.omp_spin_count
        )

    async def _wait_ready(self, name: str) -> Ready:
        actor = self.actors[name]
        deadline = time.monotonic() + self.config.ready_timeout_s
        while actor.ready is None:
            code = actor.process.poll()
            if code is not None:
                raise SupervisorError(
                    f"actor {name} exited with code {code} before it was ready (its log is above)"
                )
            if time.monotonic() > deadline:
                raise SupervisorError(
                    f"actor {name} did not send Ready within {self.config.ready_timeout_s:.0f} s"
                )
            self._ready_changed.clear()
            try:
                await asyncio.wait_for(self._ready_changed.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        if actor.ready.protocol_version != PROTOCOL_VERSION:
            raise SupervisorError(
                f"actor {name} speaks protocol {actor.ready.protocol_version}, "
                f"the supervisor {PROTOCOL_VERSION}"
            )
        return actor.ready

    # -- watch -------------------------------------------------------------------------------

    async def _receive(self) -> None:
        """Read the mailbox for as long as the supervisor runs: a message it cannot take is
        logged, never the end of the reading (heartbeats would go unread, and every actor
        be killed as silent)."""
        decoder = Decoder(SupervisorInbox)
        while True:
            data = await self.mailbox.receive()
            try:
                self._take(decoder.decode(data))
            except DecodeError as exc:
                log.error("could not decode a message: %s", exc)
            except Exception:
                log.exception("could not handle a message of %d bytes", len(data))

    def _take(self, message) -> None:
        actor = self.actors.get(message.actor)
        if actor is None or actor.process.pid != message.pid:
            return  # from a process that is gone
        actor.last_beat = time.monotonic()
        if isinstance(message, Ready):
            actor.ready = message
            actor.ready_at = actor.last_beat
            self._ready_changed.set()
        elif isinstance(message, Drained) and message.actor == "engine":
            self._drained.set()
        elif isinstance(message, Drained):  # a child refuses new requests from now on
            self._children_drained.add(message.actor)
            self._child_drained.set()
        elif isinstance(message, ActorError):
            actor.errors += 1
            log.warning("%s reported: %s", message.actor, message.message)

    async def _monitor(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            for actor in list(self.actors.values()):
                code = actor.process.poll()
                silent = time.monotonic() - actor.last_beat
                if code is None and actor.ready and silent > 3 * interval:
                    log.error(
                        "actor %s (pid %d) sent no heartbeat for %.1f s: killing it",
                        actor.name,
                        actor.process.pid,
                        silent,
                    )
                    actor.process.kill()
                    code = await asyncio.to_thread(actor.process.wait)
                if code is not None:
                    await self._restart(actor, code)
                    if self._done.is_set():
                        return
            await asyncio.sleep(0.05)

    async def _publish_roster(self) -> None:
        """The roster every heartbeat interval, restarts or not (its heartbeat instants), on a
        task of its own: the monitor waits out a restart, and the Engine must hear meanwhile
        how the others are. Changes (a death, a recovery) are sent at once besides."""
        while True:
            self._send_roster()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _restart(self, actor: ActorProcess, code: int) -> None:
        """Replace a dead actor, then reset the step state everywhere (see the module doc)."""
        noticed = time.monotonic()
        actor.died(code, noticed)
        self._send_roster()  # health replies say so from now on, not once it is back
        window = self.config.restart_window_s
        recent = actor.recent_deaths(noticed, window)
        if recent >= self.config.max_restarts:
            self.failure = (
                f"actor {actor.name} (pid {actor.process.pid}) exited with code {code}"
                f", its death number {recent + 1} within {window:.0f} s: restart "
                f"budget (max_restarts={self.config.max_restarts}) exhausted"
            )
            log.error(self.failure)
            await self.stop()
            return
        delay = restart_delay(recent)
        log.error(
            "actor %s (pid %d) exited with code %s; restarting in %.2f s (%d in the last %.0f s)",
            actor.name,
            actor.process.pid,
            code,
            delay,
            recent + 1,
            window,
        )
        actor.restart_times.append(noticed)
        await asyncio.sleep(delay)
        self._spawn(actor.name, restart=True)
        replacement = self.actors[actor.name]
        try:
            await self._wait_ready(actor.name)
        except SupervisorError as exc:
            log.error("restart failed: %s", exc)
            if replacement.process.poll() is None:
                replacement.process.kill()
            return  # the monitor sees the exit and tries again, within the budget
        if actor.name not in self.children:  # they hold no step state to reset
            self.epoch += 1
            self._send("scheduler", Reset(self.epoch, actor.name))
        replacement.recovered(time.monotonic() - noticed)
        self._send_roster()
        log.warning(
            "actor %s is back (pid %d) in %.2f s; epoch %d",
            actor.name,
            replacement.process.pid,
            replacement.last_recovery_s,
            self.epoch,
        )

    def _send_roster(self) -> None:
        if "engine" in self.actor_names:  # a tree of the gateway alone has no one to tell
            self._send("engine", Roster([a.entry() for a in self.actors.values()]))

    def statuses(self) -> list[ActorStatus]:
        now = time.monotonic()
        return [a.entry().status(now) for a in self.actors.values()]

    def tell(self, name: str, message) -> None:
        """Send `message` to the mailbox of actor or child `name` (the serving process tells its
        gateway where a replica moved: cli/ray_serve.py)."""
        self._send(name, message)

    def _send(self, name: str, message) -> None:
        socket = self._outboxes.get(name)
        if socket is None:
            socket = self.ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 500)
            socket.connect(self.config.addresses.mailbox(name))
            self._outboxes[name] = socket
        socket.send(encode(message))

    # -- stop --------------------------------------------------------------------------------

    async def wait(self) -> None:
        """Return when the tree has stopped; raise SupervisorError if an actor died."""
        await self._done.wait()
        if self.failure:
            raise SupervisorError(self.failure)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests and wait for in-flight ones to finish (a tree without an Engine:
        its children's refusal only); False on timeout, or with the Engine gone."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        engine = self.actors.get("engine")
        if "engine" in self.actor_names and (engine is None or engine.process.poll() is not None):
            return False
        await self._drain_children()
        if engine is None:
            return True
        self._drained.clear()
        self._send("engine", Drain())
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            log.warning("drain: requests still live after %.0f s; stopping anyway", timeout_s)
            return False

    async def _drain_children(self, timeout_s: float = 5.0) -> None:
        """Have the children (the gateway) refuse new requests, and wait until each says so, so
        that none reaches the Engine once it drains (a child that does not answer in time is
        waited for no longer)."""
        self._children_drained.clear()
        for name in self.children:
            self._send(name, Drain())
        deadline = time.monotonic() + timeout_s
        while not self._children_drained >= set(self.children):
            self._child_drained.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "drain: no Drained from %s", set(self.children) - self._children_drained
                )
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._child_drained.wait(), left)

    async def stop(self, reason: str = "shutdown") -> None:
        """Stop the actors in order (Engine first), each by Stop, then SIGKILL. (An actor takes
        SIGTERM only once its supervisor is gone: Actor._on_sigterm.)"""
        if self._done.is_set():
            return
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for name in (*self.children, *reversed(self.actor_names)):
            actor = self.actors.get(name)
            if actor is None or actor.process.poll() is not None:
                continue
            self._send(name, Stop(reason))
            if not await actor.wait_exit(self.config.stop_timeout_s):
                actor.process.kill()
                await actor.wait_exit(5.0)
        for socket in self._outboxes.values():
            socket.close(linger=0)
        if self.mailbox is not None:
            self.mailbox.close()
        if self.ctx is not None:
            self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self._done.set()
