"""`actorserve serve`: the engine, and the HTTP gateway on it, until SIGTERM/SIGINT.

`--role` picks the part of the stack this process runs (`plan` decides what each role starts):

    all      the engine stacks (`--data-parallel-size` of them) and the HTTP gateway on them
    engine   one engine stack, no HTTP: a replica that gateways on other hosts route to, at its
             client `--address` (tcp:// with CurveZMQ keys)
    gateway  the HTTP gateway alone, routing across `--replicas` (no actors; `--model` still
             gives the tokenizer, the chat template and the model's facts)

The cut is engine | gateway because data parallelism places whole stacks: each replica is an
independent engine, and the gateway's only traffic to it is requests and their tokens. A Worker
on another host than its Scheduler would put every step's round trip (the StepPlan out, the
sampled tokens back) on the network, on the critical path of every token: no role splits a stack.

`--placement ray` (cli/ray_serve.py) is role `all` with each engine stack placed by a Ray
cluster, in a Ray actor of its own; it reuses this module's gateway tree and settings.

The gateway is a supervised process of its own (gateway/process.py), serving on a socket bound
here, so a restarted gateway serves on the same port. With one engine stack its supervisor is
that stack's; with `--data-parallel-size` N > 1, and under `--role gateway`, it has a supervisor
tree of its own (`gateway_tree`), so any replica may end and the server goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal

import msgspec

from ..actors.runtime.config import EngineConfig
from ..actors.runtime.curve import with_own_client
from ..actors.supervisor.actor_process import Child
from ..actors.supervisor.supervisor import Supervisor, SupervisorError
from ..gateway.curve_keys import ClientKeys
from ..gateway.process import NAME, GatewaySpec
from ..gateway.replica_keys import replica_keys
from ..gateway.server import bind
from ..gateway.service import GatewaySettings
from .flags import comma_list, given_values


def gateway_tree(config: EngineConfig) -> Supervisor:
    """The gateway's own supervisor tree (`--role gateway`, and `--data-parallel-size` > 1): no
    actors, the gateway its only child, watched and restarted as in an engine stack's tree."""
    return Supervisor(config, None, actors=())


class Plan(msgspec.Struct, kw_only=True):
    """What one `actorserve serve` runs: its supervisor trees (the first holds the gateway),
    and the gateway's settings and keys when it serves HTTP."""

    trees: list[Supervisor]
    settings: GatewaySettings | None = None
    engine_keys: list[ClientKeys | None] = []  # by position in settings.replicas


def plan(
    role: str, config: EngineConfig, address: str | None, http: argparse.Namespace | None
) -> Plan:
    """The one place that decides what each role starts; ValueError (naming the flag) when the
    flags do not fit the role, or OSError when a file cannot be read."""
    check_role(role, config, address, http)
    if role == "engine":
        return Plan(trees=[Supervisor(config, address)])
    own_client: dict = {}
    if role == "gateway":
        trees: list[Supervisor] = [gateway_tree(config)]
    else:
        config, own_client = with_own_client(config)  # the gateway's key, for a CURVE engine
        count = config.data_parallel_size
        trees = [
            Supervisor(replica_config(config, i), address if i == 0 else None) for i in range(count)
        ]
        if count > 1 and http is not None:  # the gateway outlives any one replica
            trees.insert(0, gateway_tree(config))
    if http is None:
        return Plan(trees=trees)
    try:  # the settings take the model's facts, which the supervisor has read
        settings = gateway_settings(http, trees[0].config)
        keys = replica_keys(settings, config.insecure_loopback)
    except (ValueError, OSError):
        for tree in trees:
            shutil.rmtree(tree.run_dir, ignore_errors=True)
        raise
    if settings.replicas:
        return Plan(trees=trees, settings=settings, engine_keys=keys)
    own = ClientKeys.of(**own_client) if own_client else None
    engines = engine_trees(trees)
    addresses = [tree.client_address for tree in engines] if len(engines) > 1 else []
    settings = msgspec.structs.replace(settings, replicas=addresses)
    return Plan(trees=trees, settings=settings, engine_keys=[own] * len(engines))


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s config: on CUDA devices named `cuda[:B]`, its tensor-parallel ranks
    start tensor_parallel_size devices after the previous replica's (B + index x TP), so no
    two replicas share a device. `auto` and `cpu` stay as given (replicas on the CPU share
    the cores: resolve_device gives each its part)."""
    device = config.device
    if index == 0 or not (device == "cuda" or device.startswith("cuda:")):
        return config
    base = int(device.partition(":")[2] or 0)
    first = base + index * config.tensor_parallel_size
    return msgspec.structs.replace(config, device=f"cuda:{first}")


def engine_trees(trees: list[Supervisor]) -> list[Supervisor]:
    """The trees that run an engine stack (replica 0 first), the gateway's own left out."""
    return [tree for tree in trees if tree.actor_names]


def check_role(
    role: str, config: EngineConfig, address: str | None, http: argparse.Namespace | None
) -> None:
    """ValueError, naming the flag, when the flags ask what `role` does not run."""
    replicas = http is not None and bool(http.replicas)
    if config.placement == "ray" and (role != "all" or address is not None or replicas):
        raise ValueError(
            "--placement ray places the engine stacks and serves HTTP across them: with the "
            "default --role all and no --address or --replicas (Ray gives each its address)"
        )
    if config.placement == "ray" and http is None:
        raise ValueError("--placement ray is `actorserve serve`'s")
    if role == "engine" and config.data_parallel_size > 1:
        raise ValueError(
            "--role engine runs one engine stack: start one per replica, each with its own "
            "--address, instead of --data-parallel-size"
        )
    if role == "engine" and replicas:
        raise ValueError("--replicas is the gateway's: --role engine serves no HTTP")
    if role == "gateway" and (address is not None or config.data_parallel_size > 1):
        raise ValueError(
            "--role gateway starts no engine (no --address, no --data-parallel-size): it "
            "routes across --replicas"
        )
    if role == "gateway" and not replicas:
        raise ValueError("--role gateway needs --replicas: the engines it routes across")


async def serve(
    config: EngineConfig,
    address: str | None,
    http: argparse.Namespace | None = None,
    role: str = "all",
) -> int:
    """Run what `role` runs (`plan`) until SIGTERM/SIGINT; the exit code.

    SIGTERM: the gateway answers 503 to new requests, the engines drain those in flight (up to
    drain_timeout_s), the gateway closes its connections, the actors stop; exit 0.

    `data_parallel_size` N: N engine stacks, each its own supervisor tree, run directory and
    client address (replica 0 at `address`, the others in their run directories), and one
    gateway in a tree of its own, routing across them (gateway/replicas.py). A replica whose
    supervisor gives up is left down (the gateway routes around it); the server ends when the
    gateway's tree ends, or when every replica has.
    """
    log = logging.getLogger("actorserve")
    try:
        served = plan(role, config, address, http)
    except (ValueError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    replicas = served.trees
    supervisor = replicas[0]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    url = listening = None
    if served.settings is not None:
        try:
            url, listening = supervise_gateway(supervisor, http, served)
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
    engines = engine_trees(replicas)
    if role == "gateway":
        count = len(served.settings.replicas)
        print(f"actorserve: gateway for {config.model} across {count} replicas", flush=True)
    else:
        print(f"actorserve: serving {config.model} at {engines[0].client_address}", flush=True)
    if url is not None:
        print(f"actorserve: {url}", flush=True)
    for i, replica in enumerate(engines[1:], 1):
        print(f"actorserve: replica {i} at {replica.client_address}", flush=True)
    waiters = [asyncio.ensure_future(replica.wait()) for replica in replicas]
    stopper = asyncio.ensure_future(stopping.wait())
    code = await _serve_until_stopped(waiters, stopper, log)
    if code is not None:
        for replica in replicas:
            await replica.stop("the server ends")
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
    """Until SIGTERM (None), or the exit code once the first tree (`waiters[0]`: the one that
    holds the gateway) has ended, or every tree but it has (no engine left to route to); a
    tree ending before is logged, and the gateway routes round it."""
    pending = {*waiters, stopper}
    while True:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            return None
        for waiter in done:
            if isinstance(waiter.exception(), SupervisorError):
                log.error("tree %d stopped: %s", waiters.index(waiter), waiter.exception())
        ended = waiters[0] if waiters[0].done() else None
        if ended is None and len(waiters) > 1 and all(w.done() for w in waiters[1:]):
            ended = waiters[-1]
        if ended is not None:
            stopper.cancel()
            return 1 if ended.exception() is not None else 0


def supervise_gateway(supervisor: Supervisor, http: argparse.Namespace, served: Plan):
    """Bind the HTTP port (OSError if taken) and have `supervisor` run the gateway on it, with
    the plan's settings and keys; (its URL, the listening socket: keep it open while serving).
    The spec, with the SDK's keys, goes in a 0600 file in the private run directory, not on a
    command line anyone may read."""
    sock = bind(http.host, http.port)
    port = sock.getsockname()[1]
    spec = GatewaySpec(
        config=supervisor.config,
        settings=served.settings,
        listen_fd=sock.fileno(),
        host=http.host,
        port=port,
        engine_keys=served.engine_keys,
    )
    path = write_gateway_spec(supervisor, spec)
    supervisor.supervise(Child(NAME, "actorserve.gateway.process", [path], (sock.fileno(),)))
    host = f"[{http.host}]" if ":" in http.host else http.host
    return f"http://{host}:{port}", sock


def write_gateway_spec(supervisor: Supervisor, spec: GatewaySpec) -> str:
    """Write the spec a gateway (re)starts from, 0600 in the private run directory; its path."""
    path = os.path.join(supervisor.config.addresses.run_dir, "gateway.json")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(msgspec.json.encode(spec))
    return path


def read_gateway_spec(supervisor: Supervisor) -> GatewaySpec:
    path = os.path.join(supervisor.config.addresses.run_dir, "gateway.json")
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=GatewaySpec)


def gateway_settings(args: argparse.Namespace, config: EngineConfig) -> GatewaySettings:
    """The gateway's settings: its flags, and what it takes from the resolved engine config."""
    given = given_values(args, GatewaySettings)
    given.setdefault("api_key", comma_list(os.environ.get("ACTORSERVE_API_KEY", "")))
    engines = len(given.get("replicas", [])) or config.data_parallel_size
    given.setdefault("max_concurrent_requests", config.max_live_requests * engines)
    settings = GatewaySettings(
        model_id=config.model,
        model_dir=config.model,
        max_model_len=config.max_model_len,
        vocab_size=config.facts.vocab_size,
        block_size=config.block_size,
        send_timeout_s=config.send_timeout_s,
        max_client_requests=config.client_request_limit(),
        max_client_output_tokens=config.max_client_output_tokens,
        **given,
    )
    settings.validate()
    return settings
