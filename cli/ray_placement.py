"""Ray as the placement layer (`serve --placement ray`): the data-parallel replicas' engine
stacks run in Ray actors, one each, wherever the cluster has room for them; this server keeps
the gateway and routes across them (cli/ray_serve.py). Placement belongs to an engine teams
already run, not to a scheduler of our own (DESIGN.md, "Scale past one machine").

`RayReplicas` is blocking (ray's calls are): the serving loop calls it on threads.

- `connect`: join the cluster at `ray_address`, or with none start a local one (CPUs for
  every replica at least: a local cluster is this machine, shared as the user asks; its
  engines listen on 127.0.0.1, where on a cluster each listens on its node's address).
- Keys: one CurveZMQ server key pair for every replica and one client pair for the gateway,
  made here at each start in memory and a private directory removed at once; each replica gets
  the server secret and the gateway's public key through Ray (`ReplicaFiles`), so on a cluster
  of several hosts the engines listen on tcp:// with CURVE, admitting the gateway alone. (Keep
  the Ray cluster itself private, as Ray's own docs ask: its members can read what it carries.)
- `start(index)`: a Ray actor (cli/ray_replica.py) with the replica's resources: num_cpus =
  ray_replica_cpus; num_gpus = tensor_parallel_size where the replica runs on CUDA (`--device
  cuda`, or `auto` on a cluster with GPUs: Ray's CUDA_VISIBLE_DEVICES then names its devices,
  so the replica's device is plain `cuda`). Its client address comes back from the actor.
- `lost(timeout_s)`: the replicas whose engine process exited or whose Ray actor Ray reports
  dead (node lost, `ray.kill`), each with why; `replace(index)` kills what is left of one and
  starts another (at another address: the gateway is told, cli/ray_serve.py).
- `stop`: each engine drains (SIGTERM) and stops, its Ray actor is killed, and a cluster this
  server started is shut down with its processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..actors.runtime.config import EngineConfig
from ..gateway.curve_keys import (
    ClientKeys,
    load_client_keys,
    load_server_public_key,
    write_keys,
)
from .flags import as_flags
from .ray_replica import ReplicaFiles, ReplicaHost

log = logging.getLogger("actorserve.ray")

# Settings of the serving process, not of an engine stack: never on a replica's command line
PLACEMENT_FIELDS = frozenset({"placement", "ray_address", "ray_replica_cpus", "data_parallel_size"})
START_GRACE_S = 60.0  # beyond ready_timeout_s: the Ray actor's own start (a worker process)


class RayUnavailable(RuntimeError):
    """Ray cannot be imported or its cluster reached: `serve --placement ray` cannot run."""


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            f"placement ray needs Ray: pip install 'actorserve[ray]' ({exc})"
        ) from exc
    return ray


def make_keys() -> tuple[ReplicaFiles, ClientKeys]:
    """The replicas' server key pair and the gateway's client pair: what each replica writes,
    and what the gateway connects with."""
    directory = tempfile.mkdtemp(prefix="actorserve-keys-")  # 0700, removed at once
    try:
        paths = write_keys(Path(directory) / "keys")
        files = ReplicaFiles(
            paths["server_secret"].read_bytes(), paths["authorized_client"].read_bytes()
        )
        gateway = ClientKeys.of(
            load_server_public_key(paths["server_public"]),
            load_client_keys(paths["client_secret"]),
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return files, gateway


def replica_values(config: EngineConfig, given: dict, gpus: int) -> dict:
    """The engine settings of each replica's `serve --role engine`: the user's, less the
    placement's own, its Worker's threads its CPUs when unset, plain `cuda` on Ray's GPUs."""
    values = {k: v for k, v in given.items() if k not in PLACEMENT_FIELDS}
    values["model"] = config.model
    values.setdefault("torch_threads", config.ray_replica_cpus)
    if gpus and str(values.get("device", "auto")).startswith("cuda"):
        values["device"] = "cuda"
    return values


class RayReplicas:
    """The replicas' Ray actors (see the module doc)."""

    def __init__(self, config: EngineConfig, given: dict):
        """`given`: the engine settings the user set (cli.flags.given_values)."""
        self.config = config
        self.given = given
        self.ray = import_ray()
        self.host: str | None = None  # where the engines listen; None: their node's address
        self.files, self.gateway_keys = make_keys()
        self.actors: dict[int, object] = {}  # index -> its Ray actor handle
        self.exits: dict[int, object] = {}  # index -> the ObjectRef of its wait_exit()
        self.gpus = 0

    def connect(self) -> None:
        """Join `ray_address`, or start a local cluster (RayUnavailable if neither works)."""
        ray, config = self.ray, self.config
        options = {"include_dashboard": False, "configure_logging": False}
        try:
            if config.ray_address is None:
                needed = config.data_parallel_size * config.ray_replica_cpus
                # "local": a new cluster, whatever RAY_ADDRESS or a running one says
                ray.init("local", num_cpus=max(os.cpu_count() or 1, needed), **options)
                self.host = "127.0.0.1"  # this machine alone: the engines listen on loopback
            else:
                ray.init(address=config.ray_address, **options)
        except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError...
            raise RayUnavailable(f"cannot start or join a Ray cluster: {exc}") from exc
        on_gpu = config.device.startswith("cuda") or (
            config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        self.gpus = config.tensor_parallel_size if on_gpu else 0

    def start(self, index: int) -> str:
        """Start replica `index` in a Ray actor of its own; its client address once it serves
        (RuntimeError naming the replica if it does not)."""
        values = replica_values(self.config, self.given, self.gpus)
        actor_class = self.ray.remote(ReplicaHost).options(
            name=f"actorserve-replica-{index}-{os.getpid()}-{time.monotonic_ns()}",
            num_cpus=self.config.ray_replica_cpus,
            num_gpus=self.gpus,
            max_concurrency=4,  # wait_exit blocks while stop is asked
            max_restarts=0,  # we replace a lost replica ourselves, at a new address
        )
        actor = actor_class.remote(as_flags(values), self.files)
        self.actors[index] = actor
        timeout_s = self.config.ready_timeout_s + START_GRACE_S
        try:
            address = self.ray.get(
                actor.start.remote(self.config.ready_timeout_s, self.host), timeout=timeout_s
            )
        except Exception as exc:
            self.kill(index)
            raise RuntimeError(f"replica {index} did not start on Ray: {exc}") from exc
        self.exits[index] = actor.wait_exit.remote()
        return address

    def lost(self, timeout_s: float) -> dict[int, str]:
        """The replicas whose engine exited, or whose Ray actor died, within `timeout_s`: why,
        by index. They are forgotten here until `replace`d."""
        refs = {ref: index for index, ref in list(self.exits.items())}  # starts add to it
        if not refs:
            time.sleep(timeout_s)
            return {}
        ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        reasons = {}
        for ref in ready:
            index = refs[ref]
            if self.exits.get(index) is not ref:  # replaced meanwhile
                continue
            del self.exits[index]
            try:
                code = self.ray.get(ref)
                reasons[index] = f"its engine exited with code {code}"
            except Exception as exc:  # RayActorError: the actor, or its node, is gone
                reasons[index] = f"Ray lost its actor ({type(exc).__name__})"
        return reasons

    def replace(self, index: int) -> str:
        """Kill what is left of replica `index` and start another; its new address."""
        self.kill(index)
        return self.start(index)

    def kill(self, index: int) -> None:
        actor = self.actors.pop(index, None)
        self.exits.pop(index, None)
        if actor is not None:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("ray.kill(replica %d): %s", index, exc)

    def stop(self) -> None:
        """Drain and stop every replica, kill their Ray actors, shut a cluster we started."""
        timeout_s = self.config.drain_timeout_s + 4 * self.config.stop_timeout_s
        stops = {i: actor.stop.remote(timeout_s) for i, actor in self.actors.items()}
        for index, ref in stops.items():
            try:
                self.ray.get(ref, timeout=timeout_s + 15)
            except Exception as exc:
                log.warning("replica %d did not stop cleanly: %s", index, exc)
        for index in list(self.actors):
            self.kill(index)
        if self.ray.is_initialized():
            self.ray.shutdown()
