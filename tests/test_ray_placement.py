"""`actorserve serve --placement ray`: the data-parallel replicas' engine stacks in Ray actors
(one each) on a local Ray cluster the server starts itself (its engines on 127.0.0.1), the
gateway here routing across them. A replica whose engine tree is SIGKILLed, or whose Ray actor
dies, is replaced; its streams go on on the other replica and end as in a fault-free run; and
SIGTERM leaves no process behind, Ray's own included.

One server (and one Ray cluster) for the module: Ray and two stacks are most of the time. The
tests run in file order; the last stops the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from gateway_support import call, streams_through_a_fault, wait_until

from support import TEST_KV_CACHE_GB, prompts_of_lengths

pytest.importorskip("ray", reason="Ray is in the `ray` extra (pip install 'actorserve[ray]')")

pytestmark = pytest.mark.slow
FLAGS = (
    "--placement",
    "ray",
    "--data-parallel-size",
    "2",
    "--route-policy",
    "round_robin",  # the streams spread over both replicas, whatever their prompts
    "--max-model-len",
    "512",
    "--kv-cache-memory-gb",
    TEST_KV_CACHE_GB,
    "--health-interval-s",
    "0.5",
    "--engine-liveness-timeout-s",
    "4",
    "--cpu-fast-path",
    "false",  # plain torch, the same tokens, slower: the streams are mid-way when one is cut
)
# test_data_parallel.py checks these lengths' prompts keep a clear greedy winner for 120 tokens,
# so a stream resumed elsewhere (prompt + output prefilled again) continues as it began
PROMPT_LENGTHS = [9, 12, 14, 20, 33, 44]
MAX_TOKENS = 120
CANNOT_START = "cannot start or join a Ray cluster"


class RayServer:
    """`actorserve serve --placement ray --port 0` in a subprocess: its replicas' first
    addresses and the gateway's URL, from what it prints (the shape gateway_support's calls
    take)."""

    def __init__(self, model: Path, *flags: str):
        self.run_dir = tempfile.mkdtemp(prefix="actorserve-ray-test-")
        self.log_path = Path(self.run_dir) / "serve.log"
        self._log = open(self.log_path, "w")
        command = [sys.executable, "-m", "actorserve.cli", "serve", "--model", str(model)]
        self.proc = subprocess.Popen(
            [*command, "--port", "0", *flags],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.model_name = str(model)
        lines = [self._read_line(300) for _ in range(3)]
        served = re.fullmatch(r"actorserve: serving \S+ at (tcp://\S+)\n", lines[0])
        url = re.fullmatch(r"actorserve: (http://\S+)\n", lines[1])
        other = re.fullmatch(r"actorserve: replica 1 at (tcp://\S+)\n", lines[2])
        if not (served and url and other):
            self.proc.kill()
            self.proc.wait()
            if CANNOT_START in self.log():
                pytest.skip(f"Ray cannot start here: {self.log()[-2000:]}")
            raise RuntimeError(f"serve --placement ray did not start: {lines}\n{self.log()}")
        self.addresses = [served.group(1), other.group(1)]
        self.url = url.group(1)
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port

    def _read_line(self, timeout_s: float) -> str:
        result = [""]
        reader = threading.Thread(target=lambda: result.__setitem__(0, self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout_s)
        return result[0]

    def connection(self, timeout: float = 120.0):
        import http.client

        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def server(llama_dir):
    server = RayServer(llama_dir, *FLAGS)
    yield server
    if server.proc.poll() is None:  # a test failed before the last one stopped it
        server.proc.kill()
        server.proc.wait()


def processes() -> dict[int, tuple[int, bytes]]:
    """Every live process: pid -> (parent pid, command line). Zombies count as gone."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), cmdline)
    return found


def descendants(pid: int) -> set[int]:
    table = processes()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (parent, _) in table.items() if parent in frontier} - found
        found |= frontier
    return found


def engine_tree(address: str) -> tuple[int, int, set[int], str]:
    """The replica serving at `address`: (its Ray actor's worker process, its engine's
    supervisor, that supervisor's actors, the directory of its keys). The supervisor's parent
    is its keeper (cli/ray_replica.py `main`), whose parent is the Ray actor's worker."""
    table = processes()
    needle = f"--role\0engine\0--address\0{address}\0".encode()
    [supervisor] = [
        p for p, (parent, cmd) in table.items() if needle in cmd and b"ray_replica" not in cmd
    ]
    keeper = table[supervisor][0]
    assert b"actorserve.cli.ray_replica" in table[keeper][1]
    actors = {p for p, (parent, _) in table.items() if parent == supervisor}
    argv = table[supervisor][1].split(b"\0")
    keys = os.path.dirname(argv[argv.index(b"--curve-server-key") + 1].decode())
    return table[keeper][0], supervisor, actors, keys


def streams(server, prompts, fault=None) -> list[tuple[str, str] | None]:
    """Stream every prompt at once over SSE, greedy; (text, finish reason) of each. With
    `fault`, call it once every stream has had its first events."""
    body = {"model": server.model_name, "max_tokens": MAX_TOKENS, "temperature": 0}
    return streams_through_a_fault(server, [{**body, "prompt": p} for p in prompts], fault, 240)


@pytest.fixture(scope="module")
def fault_free(server, llama_dir):
    prompts = prompts_of_lengths(llama_dir, PROMPT_LENGTHS)
    results = streams(server, prompts)
    assert all(reason == "length" for _, reason in results)
    return prompts, results


def routed(server) -> float:
    """Requests (and resumptions) the gateway sent to any replica."""
    text = call(server, "GET", "/metrics").body.decode()
    pattern = r"actorserve_replica_requests_routed_total\{[^}]*\} (\S+)"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text))


def back_at(server, index: int, after: int) -> str | None:
    """The address replica `index` serves at again, once the log says so after `after` chars."""
    match = re.search(rf"replica {index} is back at (tcp://\S+)", server.log()[after:])
    return match.group(1) if match else None


def serves_on_every_replica(server, prompt) -> bool:
    """Both replicas up (round robin: two requests, one each) and answering."""
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 2}
    health = call(server, "GET", "/health")
    return (
        health.status == 200
        and json.loads(health.body)["status"] == "ok"
        and all(call(server, "POST", "/v1/completions", body).status == 200 for _ in range(2))
    )


def test_streams_of_a_replica_whose_engine_tree_is_sigkilled_end_as_without_the_fault(
    server, fault_free
):
    prompts, expected = fault_free
    ray_worker, supervisor, actors, _ = engine_tree(server.addresses[0])
    assert len(actors) == 4  # engine, scheduler, block manager, worker
    mark = len(server.log())

    def kill_replica_0() -> None:
        for pid in (supervisor, *actors):
            os.kill(pid, signal.SIGKILL)

    before = routed(server)
    assert streams(server, prompts, kill_replica_0) == expected
    assert routed(server) - before > len(prompts)  # replica 0's streams were resumed
    assert "replica 0 lost: its engine exited with code -9" in server.log()[mark:]
    server.addresses[0] = wait_until(lambda: back_at(server, 0, mark), 120)
    assert server.addresses[0] is not None, server.log()[mark:]
    assert wait_until(lambda: serves_on_every_replica(server, prompts[0]), 30)
    assert wait_until(lambda: ray_worker not in processes(), 15)  # its Ray actor was killed


def test_streams_of_a_replica_whose_ray_actor_dies_end_as_without_the_fault(server, fault_free):
    prompts, expected = fault_free
    ray_worker, supervisor, actors, keys = engine_tree(server.addresses[1])
    assert os.path.isfile(os.path.join(keys, "server.key_secret"))
    mark = len(server.log())

    def kill_ray_actor_of_replica_1() -> None:
        os.kill(ray_worker, signal.SIGKILL)

    before = routed(server)
    assert streams(server, prompts, kill_ray_actor_of_replica_1) == expected
    assert routed(server) - before > len(prompts)  # replica 1's streams were resumed
    lost = "replica 1 lost: Ray lost its actor"
    assert wait_until(lambda: lost in server.log()[mark:], 60), server.log()[mark:]
    # the engine's tree died with its Ray actor (its keeper's PR_SET_PDEATHSIG, then the
    # engine's and the actors' own), and its secret key with it
    assert wait_until(lambda: not {supervisor, *actors} & set(processes()), 15)
    assert wait_until(lambda: not os.path.exists(keys), 15)
    server.addresses[1] = wait_until(lambda: back_at(server, 1, mark), 120)
    assert server.addresses[1] is not None, server.log()[mark:]
    assert wait_until(lambda: serves_on_every_replica(server, prompts[0]), 30)


def test_sigterm_stops_every_process_ray_included_and_exits_0(server):
    tree = descendants(server.proc.pid)
    commands = b" ".join(cmd for p, (_, cmd) in processes().items() if p in tree)
    assert b"raylet" in commands and b"--role\0engine" in commands  # Ray's and the replicas'
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0
    deadline = time.monotonic() + 30
    while tree & set(processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: cmd[:120] for p, (_, cmd) in processes().items() if p in tree}
    assert not left, left
