"""One data-parallel replica inside a Ray actor: `actorserve serve --role engine` (its supervisor
and four actors) as the Ray actor's child process, on the node Ray placed it on.

`ReplicaHost` is a plain class; cli/ray_placement.py makes it a Ray actor with the replica's
resources (`ray.remote(num_cpus=..., num_gpus=...)(ReplicaHost)`), so this module imports ray
only inside the method that asks Ray for its node's address, and runs in the Ray worker.

- `start`: write the replica's CurveZMQ files (its server secret key, the gateway's public key as
  its one authorized client) into a private 0700 directory, pick a free port on the node's
  address as Ray knows it (127.0.0.1 on a local cluster), start the engine there, and return
  its client address once the engine says it serves (`actorserve: serving MODEL at ADDRESS`).
- The engine's process dies with the Ray actor, and its key directory with it: it runs under
  a keeper, `python -m actorserve.cli.ray_replica PARENT_PID KEYS_DIR serve ...` (this module's
  `main`), which asks for SIGHUP when the Ray actor's thread that started it ends
  (PR_SET_PDEATHSIG fires when the *thread* ends, so a thread of the Ray actor's own starts it
  and lives as long as it does: a Ray actor's methods may run on pool threads). On SIGHUP the
  keeper SIGKILLs the engine; on SIGTERM (`stop`) it passes it on; when the engine has exited
  it removes the key directory (the engine reads its keys again whenever its supervisor
  restarts the Engine, so they stay while it lives) and ends as the engine did (its code, or
  its signal). The engine dies with the keeper in turn (its own PR_SET_PDEATHSIG, SIGKILL), and
  its actors with its supervisor: nothing outlives the Ray actor, and no secret key stays on
  the node after a SIGKILL of the Ray actor.
- `wait_exit` returns when the engine's process has exited (its exit code): the placement
  watches that, and the Ray actor's own death (the call fails), to replace the replica.
- `stop`: SIGTERM (the engine drains and exits 0), SIGKILL after `timeout_s`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import msgspec

SERVING_LINE = "actorserve: serving "  # what `serve --role engine` prints once it serves


class ReplicaFiles(msgspec.Struct, frozen=True):
    """What a replica writes before it starts: its server certificate (the secret one) and the
    public certificate of the one client it admits (the gateway), as `actorserve keys` writes
    them."""

    server_secret: bytes
    authorized_client: bytes


class ReplicaHost:
    """The Ray actor of one replica (see the module doc)."""

    def __init__(self, engine_argv: list[str], files: ReplicaFiles):
        self.engine_argv = engine_argv  # `serve` flags: --model and the user's engine settings
        self.files = files
        self.process: subprocess.Popen | None = None
        self.keys_dir: str | None = None
        self.address: str | None = None
        self.exit_code: int | None = None
        self._serving = threading.Event()
        self._exited = threading.Event()

    def start(self, timeout_s: float, host: str | None = None) -> str:
        """Start the engine on `host` (None: this node's address in the cluster); its client
        address once it serves. RuntimeError when it exits first or is not serving within
        `timeout_s`."""
        host = host or node_address()
        self.address = f"tcp://{f'[{host}]' if ':' in host else host}:{free_port(host)}"
        self.keys_dir = tempfile.mkdtemp(prefix="actorserve-replica-")  # mode 0700
        server_key = os.path.join(self.keys_dir, "server.key_secret")
        authorized = os.path.join(self.keys_dir, "authorized_clients")
        os.mkdir(authorized, 0o700)
        write_private(server_key, self.files.server_secret)
        write_private(os.path.join(authorized, "gateway.key"), self.files.authorized_client)
        command = [
            *("serve", "--role", "engine", "--address", self.address),
            *("--curve-server-key", server_key, "--curve-authorized-clients", authorized),
            *self.engine_argv,
        ]
        threading.Thread(target=self._keep, args=(command,), daemon=True).start()
        self._serving.wait(timeout_s)
        if self.exit_code is not None or not self._serving.is_set():
            self.stop(0.0)
            raise RuntimeError(
                f"the replica's engine at {self.address} "
                + (
                    f"exited with code {self.exit_code} before it served (its log is above)"
                    if self.exit_code is not None
                    else f"was not serving within {timeout_s:.0f} s"
                )
            )
        return self.address

    def _keep(self, command: list[str]) -> None:
        """Start the engine, echo its output to our stderr (Ray's log), and wait for its end.
        Runs on a thread of its own that ends with the engine (PR_SET_PDEATHSIG: the module doc)."""
        keeper = [sys.executable, "-m", "actorserve.cli.ray_replica", str(os.getpid())]
        self.process = subprocess.Popen(
            [*keeper, self.keys_dir or "", *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a signal to the Ray worker's group is not the engine's
        )
        for line in self.process.stdout:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith(SERVING_LINE):
                self._serving.set()
        self.exit_code = self.process.wait()
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
        self._exited.set()
        self._serving.set()  # a start still waiting learns of the exit at once

    def wait_exit(self) -> int | None:
        """When the engine's process has exited: its exit code (Popen's: -N for signal N)."""
        self._exited.wait()
        return self.exit_code

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the engine (it drains, then stops its actors); SIGKILL after `timeout_s`."""
        process = self.process
        if process is None or self._exited.is_set():
            return self.exit_code
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        if not self._exited.wait(timeout_s):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            self._exited.wait(10.0)
        return self.exit_code


def node_address() -> str:
    """This node's address as the Ray cluster knows it (the one its other nodes reach it at)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the engine binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def write_private(path: str, data: bytes) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)


def die_with_parent(signum: int) -> None:
    """Ask the kernel for `signum` when the thread that started this process ends (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    """`python -m actorserve.cli.ray_replica PARENT_PID KEYS_DIR serve ...`: keep `actorserve
    serve ...` while PARENT_PID's thread that started us lives (the module doc)."""
    parent_pid, keys_dir, command = int(argv[0]), argv[1], argv[2:]
    engine: subprocess.Popen | None = None

    def on_signal(signum: int, _frame: object) -> None:
        if engine is None:  # before the engine started (one that is starting dies with us)
            raise SystemExit(1)
        if signum == signal.SIGHUP:
            engine.kill()
        else:
            engine.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    die_with_parent(signal.SIGHUP)
    try:
        if os.getppid() != parent_pid:  # it died before the prctl
            return 1
        engine = subprocess.Popen(
            [sys.executable, "-m", "actorserve.cli", *command],
            # a preexec_fn is safe here: the keeper has one thread
            preexec_fn=lambda: die_with_parent(signal.SIGKILL),
        )
        code = engine.wait()
    finally:
        if keys_dir:
            shutil.rmtree(keys_dir, ignore_errors=True)
    if code < 0:  # end as the engine did: ReplicaHost reports its code
        if -code != signal.SIGKILL:  # (SIGKILL's action cannot be set, nor needs to be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
