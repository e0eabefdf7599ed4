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
    """
    log = logging.getLogger("actorserve")
    try:
        config, own_client = with_own_client(config)  # the gateway's key, for a CURVE engine
        supervisor = Supervisor(config, address)
    except (ValueError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    url = listening = None
    if http is not None:
        try:
            url, listening = supervise_gateway(supervisor, http, own_client)
        except OSError as exc:
            log.error("cannot serve HTTP on %s port %s: %s", http.host, http.port, exc)
            await supervisor.stop("the gateway could not start")
            return 1
    try:
        await supervisor.start()
    except SupervisorError as exc:
        log.error("cannot serve: %s", exc)
        return 1
    print(f"actorserve: serving {config.model} at {supervisor.client_address}", flush=True)
    if url is not None:
        print(f"actorserve: {url}", flush=True)
    waiter = asyncio.ensure_future(supervisor.wait())
    stopper = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if waiter.done():
        stopper.cancel()
        try:
            waiter.result()
        except SupervisorError as exc:
            log.error("engine stopped: %s", exc)
            return 1
        return 0
    await supervisor.drain()
    await supervisor.stop("SIGTERM")
    waiter.cancel()
    if listening is not None:
        listening.close()
    return 0


def supervise_gateway(supervisor: Supervisor, http: argparse.Namespace, client: dict):
    """Bind the HTTP port (OSError if taken) and have the supervisor run the gateway on it;
    (its URL, the listening socket: keep it open while serving). The spec, with the SDK's keys,
    goes in a 0600 file in the private run directory, not on a command line anyone may read."""
    sock = bind(http.host, http.port)
    port = sock.getsockname()[1]
    spec = GatewaySpec(
        config=supervisor.config,
        settings=gateway_settings(http, supervisor.config),
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
    given.setdefault("max_concurrent_requests", config.max_live_requests)
    return GatewaySettings(
        model_id=config.model,
        model_dir=config.model,
        max_model_len=config.max_model_len,
        vocab_size=config.facts.vocab_size,
        **given,
    )
