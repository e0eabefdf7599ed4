"""`actorserve serve`: the engine, and the HTTP gateway on it, until SIGTERM/SIGINT.

The gateway is a supervised process of its own (gateway_process.py), serving on a socket bound
here, so a restarted gateway serves on the same port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import msgspec

from .actors.actor_process import Child
from .actors.config import EngineConfig
from .actors.curve import with_own_client
from .actors.supervisor import Supervisor, SupervisorError
from .config_flags import given_values
from .gateway.server import bind
from .gateway.service import GatewaySettings
from .gateway_process import NAME, GatewaySpec


async def serve(
    config: EngineConfig, address: str | None, http: argparse.Namespace | None = None
) -> int:
    """Run the engine (and, with `http`, the gateway on it) until SIGTERM/SIGINT; the exit code.

    The gateway is a supervised process of its own (gateway_process.py), serving on a socket
    bound here, so a restarted gateway serves on the same port. SIGTERM: the gateway answers
    503 to new requests, the engine drains those in flight (up to drain_timeout_s), the
    gateway closes its connections, the actors stop; exit 0.

    `data_parallel_size` N: N engine stacks, each its own supervisor tree, run directory and
    client address (replica 0 at `address`, the others in their run directories), and one
    gateway, supervised by replica 0's supervisor, routing across them (gateway/replicas.py).
    A replica whose supervisor gives up is left down (the gateway routes around it); the
    server ends when replica 0, which holds the gateway, ends.
    """
    log = logging.getLogger("actorserve")
    try:
        config, own_client = with_own_client(config)  # the gateway's key, for a CURVE engine
        replicas = [
            Supervisor(config, address if i == 0 else None)
            for i in range(config.data_parallel_size)
        ]
    except (ValueError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    supervisor = replicas[0]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    url = listening = None
    if http is not None:
        try:
            url, listening = supervise_gateway(replicas, http, own_client)
        except OSError as exc:
            log.error("cannot serve HTTP on %s port %s: %s", http.host, http.port, exc)
            for replica in replicas:
                await replica.stop("the gateway could not start")
            return 1
    started: list[Supervisor] = []
    try:
        for replica in (*replicas[1:], supervisor):  # the gateway's last, as its engine's are
            started.append(replica)
            await replica.start()
    except SupervisorError as exc:
        log.error("cannot serve: %s", exc)
        for replica in started:
            await replica.stop("another replica could not start")
        return 1
    print(f"actorserve: serving {config.model} at {supervisor.client_address}", flush=True)
    if url is not None:
        print(f"actorserve: {url}", flush=True)
    for i, replica in enumerate(replicas[1:], 1):
        print(f"actorserve: replica {i} at {replica.client_address}", flush=True)
    waiters = [asyncio.ensure_future(replica.wait()) for replica in replicas]
    stopper = asyncio.ensure_future(stopping.wait())
    code = await _serve_until_stopped(waiters, stopper, log)
    if code is not None:
        for replica in replicas:
            await replica.stop("replica 0 stopped")
        return code
    await supervisor.drain()  # the gateway first: no new request reaches any replica after
    await asyncio.gather(*(replica.drain() for replica in replicas[1:]))
    for replica in replicas:
        await replica.stop("SIGTERM")
    for waiter in waiters:
        waiter.cancel()
    if listening is not None:
        listening.close()
    return 0


async def _serve_until_stopped(waiters, stopper, log) -> int | None:
    """Until SIGTERM (None) or until replica 0 (`waiters[0]`), which holds the gateway, has
    ended (the exit code); another replica ending is logged, and the gateway routes round it."""
    pending = {*waiters, stopper}
    while True:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            return None
        for waiter in done:
            if isinstance(waiter.exception(), SupervisorError):
                log.error("replica %d stopped: %s", waiters.index(waiter), waiter.exception())
        if waiters[0].done():
            stopper.cancel()
            return 1 if waiters[0].exception() is not None else 0


def supervise_gateway(replicas: list[Supervisor], http: argparse.Namespace, client: dict):
    """Bind the HTTP port (OSError if taken) and have replica 0's supervisor run the gateway on
    it, routing across every replica; (its URL, the listening socket: keep it open while
    serving). The spec, with the SDK's keys, goes in a 0600 file in the private run directory,
    not on a command line anyone may read."""
    supervisor = replicas[0]
    sock = bind(http.host, http.port)
    port = sock.getsockname()[1]
    settings = gateway_settings(http, supervisor.config)
    if len(replicas) > 1 and not settings.replicas:
        addresses = [replica.client_address for replica in replicas]
        settings = msgspec.structs.replace(settings, replicas=addresses)
    spec = GatewaySpec(
        config=supervisor.config,
        settings=settings,
        listen_fd=sock.fileno(),
        host=http.host,
        port=port,
        client_options={k: _z85_text(v) for k, v in client.items()},
    )
    path = os.path.join(supervisor.config.addresses.run_dir, "gateway.json")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(msgspec.json.encode(spec))
    supervisor.supervise(Child(NAME, "actorserve.gateway_process", [path], (sock.fileno(),)))
    host = f"[{http.host}]" if ":" in http.host else http.host
    return f"http://{host}:{port}", sock


def _z85_text(value):
    """A key (or key pair) as JSON text."""
    if isinstance(value, tuple | list):
        return [_z85_text(v) for v in value]
    return value.decode() if isinstance(value, bytes) else value


def gateway_settings(args: argparse.Namespace, config: EngineConfig) -> GatewaySettings:
    """The gateway's settings: its flags, and what it takes from the resolved engine config."""
    given = given_values(args, GatewaySettings)
    given.setdefault("api_key", os.environ.get("ACTORSERVE_API_KEY") or None)
    given.setdefault(
        "max_concurrent_requests", config.max_live_requests * config.data_parallel_size
    )
    return GatewaySettings(
        model_id=config.model,
        model_dir=config.model,
        max_model_len=config.max_model_len,
        vocab_size=config.facts.vocab_size,
        block_size=config.block_size,
        **given,
    )
