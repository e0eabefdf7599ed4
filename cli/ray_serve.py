"""`actorserve serve --placement ray`: the data-parallel replicas in Ray actors (one each, placed
by the Ray cluster: cli/ray_placement.py), the HTTP gateway here, routing across them as
`--role gateway --replicas ...` does, in a supervisor tree of its own.

While serving, a replica whose engine process tree exits, or whose Ray actor Ray reports lost
(its node gone, `ray.kill`), is replaced by a new Ray actor: the gateway is told at once
(ReplicaLost: its streams go on on the other replicas as resumptions), and again when the
replacement serves (ReplicaMoved: its new address), which also goes into the spec a restarted
gateway reads. Replacements follow the supervisor's restart budget and backoff
(`max_restarts` within `restart_window_s`, per replica); a replica past it is left down, and
the server ends (exit 1) when every replica is, or when the gateway's tree stops.

SIGTERM/SIGINT: the gateway refuses new requests, each replica drains and stops, the Ray actors
are killed, the gateway stops, and a Ray cluster this server started is shut down; exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import time
from collections import deque

import msgspec

from ..actors.runtime.config import EngineConfig
from ..actors.supervisor.actor_process import restart_delay
from ..actors.supervisor.supervisor import Supervisor, SupervisorError
from ..gateway.process import NAME
from ..messages.control import ReplicaLost, ReplicaMoved
from .flags import given_values
from .ray_placement import RayReplicas, RayUnavailable
from .serve import (
    Plan,
    check_role,
    gateway_settings,
    gateway_tree,
    read_gateway_spec,
    supervise_gateway,
    write_gateway_spec,
)

log = logging.getLogger("actorserve")
WATCH_INTERVAL_S = 0.25  # how often the replicas' Ray actors are looked at


async def serve_on_ray(
    config: EngineConfig, address: str | None, http: argparse.Namespace, role: str = "all"
) -> int:
    """Serve until SIGTERM/SIGINT with the replicas on Ray (the module doc); the exit code."""
    try:
        check_role(role, config, address, http)
        tree = gateway_tree(config)  # the checkpoint's facts, for the gateway's settings
    except (ValueError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    try:
        replicas = RayReplicas(tree.config, given_values(http, EngineConfig))
        replicas.connect()  # before our signal handlers: ours replace any ray.init sets
    except RayUnavailable as exc:
        log.error("cannot serve: %s", exc)
        shutil.rmtree(tree.run_dir, ignore_errors=True)
        return 1
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    count = config.data_parallel_size
    starts = [asyncio.to_thread(replicas.start, i) for i in range(count)]
    results = await asyncio.gather(*starts, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    listening = None
    try:
        if failed:
            raise SupervisorError(str(failed[0]))
        settings = gateway_settings(http, tree.config)
        settings = msgspec.structs.replace(settings, replicas=list(results))
        served = Plan(trees=[tree], settings=settings, engine_keys=[replicas.gateway_keys] * count)
        url, listening = supervise_gateway(tree, http, served)
        await tree.start()
    except (SupervisorError, ValueError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        await asyncio.to_thread(replicas.stop)
        await tree.stop("the replicas could not start")
        if listening is not None:
            listening.close()
        return 1
    print(f"actorserve: serving {config.model} at {results[0]}", flush=True)
    print(f"actorserve: {url}", flush=True)
    for i, other in enumerate(results[1:], 1):
        print(f"actorserve: replica {i} at {other}", flush=True)
    keeper = ReplicaKeeper(tree, replicas)
    code = await keeper.serve_until(stopping)
    if code is None:  # SIGTERM: the gateway first, so that no new request reaches a replica
        await tree.drain()
    await keeper.close()
    await asyncio.to_thread(replicas.stop)
    await tree.stop("SIGTERM" if code is None else "the server ends")
    listening.close()
    return code or 0


class ReplicaKeeper:
    """Watches the replicas' Ray actors and replaces the lost ones, telling the gateway."""

    def __init__(self, tree: Supervisor, replicas: RayReplicas):
        self.tree = tree
        self.replicas = replicas
        self.deaths: dict[int, deque[float]] = {}  # index -> when it was lost, in the window
        self.given_up: set[int] = set()
        self.restarts: dict[int, asyncio.Task] = {}

    async def serve_until(self, stopping: asyncio.Event) -> int | None:
        """Until SIGTERM (None), or the exit code once the gateway's tree has ended or every
        replica is down for good."""
        tree_done = asyncio.ensure_future(self.tree.wait())
        stopper = asyncio.ensure_future(stopping.wait())
        try:
            while True:
                watch = asyncio.ensure_future(
                    asyncio.to_thread(self.replicas.lost, WATCH_INTERVAL_S)
                )
                await asyncio.wait({watch, tree_done, stopper}, return_when="FIRST_COMPLETED")
                lost = await watch
                if stopper.done():
                    return None
                if tree_done.done():
                    return 1 if tree_done.exception() is not None else 0
                for index, reason in lost.items():
                    self.lose(index, reason)
                if len(self.given_up) == self.replicas.config.data_parallel_size:
                    log.error("every replica is down for good: the server ends")
                    return 1
        finally:
            stopper.cancel()
            tree_done.cancel()

    def lose(self, index: int, reason: str) -> None:
        """Tell the gateway, and start a replacement within the restart budget."""
        config = self.replicas.config
        self.tree.tell(NAME, ReplicaLost(index, reason))
        now = time.monotonic()
        deaths = self.deaths.setdefault(index, deque())
        while deaths and now - deaths[0] > config.restart_window_s:
            deaths.popleft()
        if len(deaths) >= config.max_restarts:
            log.error(
                "replica %d lost (%s), its death number %d within %.0f s: restart budget "
                "(max_restarts=%d) spent; the gateway routes round it",
                *(index, reason, len(deaths) + 1, config.restart_window_s, config.max_restarts),
            )
            self.replicas.kill(index)
            self.given_up.add(index)
            return
        delay = restart_delay(len(deaths))
        deaths.append(now)
        log.error("replica %d lost: %s; starting another in %.2f s", index, reason, delay)
        self.restarts[index] = asyncio.ensure_future(self.replace(index, delay))

    async def replace(self, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        started = time.monotonic()
        try:
            address = await asyncio.to_thread(self.replicas.replace, index)
        except RuntimeError as exc:  # counted as a death: the budget bounds the retries
            self.lose(index, str(exc))
            return
        spec = read_gateway_spec(self.tree)
        addresses = list(spec.settings.replicas)
        addresses[index] = address
        settings = msgspec.structs.replace(spec.settings, replicas=addresses)
        write_gateway_spec(self.tree, msgspec.structs.replace(spec, settings=settings))
        self.tree.tell(NAME, ReplicaMoved(index, address))
        log.warning(
            "replica %d is back at %s in %.2f s", index, address, time.monotonic() - started
        )

    async def close(self) -> None:
        for task in self.restarts.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
