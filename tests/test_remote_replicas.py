"""Replicas on other hosts, on loopback: two `actorserve serve --role engine` stacks on
tcp://127.0.0.2 and tcp://127.0.0.3 (Linux routes all of 127/8 to lo) with CurveZMQ, each
authorizing the gateway's client key, and one `--role gateway` server in front of them, every one
a real process. Completions over HTTP land on both replicas; a gateway whose client key no
replica authorizes gets a 503 at once that names the replica and the refused key, not a hang,
and an SDK client holding a wrong server key fails at once naming the failed handshake.

Every server of the module starts at once (the stacks' model loads are most of the time).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gateway_support import wait_until

from actorserve.gateway.client import AsyncClient
from actorserve.gateway.curve_keys import client_options, write_keys
from actorserve.gateway.errors import EngineUnavailable
from support import EngineServer, prompts_of_lengths, stop_server

pytestmark = pytest.mark.slow
HOSTS = ("127.0.0.2", "127.0.0.3")
COMMON = ("--max-model-len", "512", "--torch-threads", "1")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GatewayOnly:
    """`actorserve serve --role gateway --port 0`: `url` once it serves HTTP."""

    def __init__(self, model: Path, *flags: str):
        self.run_dir = tempfile.mkdtemp(prefix="actorserve-test-")
        self.log_path = Path(self.run_dir) / "serve.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "actorserve.cli", "serve", "--role", "gateway"]
        cmd += ["--model", str(model), "--port", "0", *COMMON, *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.url: str | None = None

    def wait_serving(self, timeout_s: float = 120.0) -> GatewayOnly:
        lines: list[str] = []  # "gateway for MODEL across 2 replicas", then the URL
        reader = threading.Thread(
            target=lambda: lines.extend(self.proc.stdout.readline() for _ in (0, 1))
        )
        reader.start()
        reader.join(timeout_s)
        match = re.fullmatch(r"actorserve: http://([\d.]+):(\d+)\n?", lines[-1] if lines else "")
        assert lines and "gateway for" in lines[0], f"{lines}\n{self.log_path.read_text()}"
        assert match, f"{lines}\n{self.log_path.read_text()}"
        self.host, self.port = match.group(1), int(match.group(2))
        return self

    def post(self, body: dict, timeout_s: float = 60.0) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            headers = {"Content-Type": "application/json"}
            conn.request("POST", "/v1/completions", json.dumps(body), headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def metrics(self) -> str:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def stop(self) -> int:
        return stop_server(self.proc, self._log, self.run_dir)


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    """Keys: the gateway's (a), each engine's own server pair (b, c) whose authorized clients
    hold a's client.key, and a stranger's (d). Then the two engines and two gateways: one with
    the right keys, one with a client key no replica knows."""
    root = tmp_path_factory.mktemp("two-hosts")
    keys = {name: write_keys(root / name) for name in "abcd"}
    for name in "bc":
        shutil.copy(keys["a"]["client_public"], keys[name]["authorized_client"].parent / "a.key")
    addresses = [f"tcp://{host}:{free_port(host)}" for host in HOSTS]

    def engine(name: str, address: str) -> EngineServer:
        return EngineServer(
            llama_dir,
            "--role", "engine",
            *COMMON,
            "--curve-server-key", str(keys[name]["server_secret"]),
            "--curve-authorized-clients", str(keys[name]["authorized_client"].parent),
            address=address,
            client_options=client_options(keys[name]["server_public"], keys[name]["client_secret"]),
        )  # fmt: skip

    def gateway(server_keys: list[str], client_key: str) -> GatewayOnly:
        return GatewayOnly(
            llama_dir,
            "--replicas", ",".join(addresses),
            "--replica-server-keys", ",".join(server_keys),
            "--curve-client-key", client_key,
            "--engine-liveness-timeout-s", "20",
            "--route-stats-interval-s", "0.2",
            "--route-policy", "kv_events",
        )  # fmt: skip

    public = {name: str(keys[name]["server_public"]) for name in "bc"}
    gateways = {
        "right": gateway([public["b"], public["c"]], str(keys["a"]["client_secret"])),
        "stranger": gateway([public["b"], public["c"]], str(keys["d"]["client_secret"])),
    }
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(engine, "bc", addresses))
    for server in gateways.values():
        server.wait_serving()
    yield addresses, engines, gateways, keys
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda server: server.stop(), (*gateways.values(), *engines)))
    assert codes == [0] * 4  # SIGTERM drains and stops a gateway-only server as any other


def routed(gateway: GatewayOnly) -> dict[str, float]:
    pattern = r'actorserve_replica_requests_routed_total\{model_name="[^"]*",replica="(\d)"\} (\S+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, gateway.metrics())}


def test_completions_through_the_gateway_land_on_both_remote_replicas(cluster, llama_dir):
    addresses, engines, gateways, _ = cluster
    gateway = gateways["right"]
    prompts = prompts_of_lengths(llama_dir, [20 + i for i in range(12)])  # 12 distinct prefixes
    body = {"max_tokens": 3, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: gateway.post({**body, "prompt": p}), prompts))
    assert all(status == 200 for status, _ in replies), replies
    assert all(reply["usage"]["completion_tokens"] == 3 for _, reply in replies)
    counts = routed(gateway)
    assert sum(counts.values()) == 12 and min(counts.get(r, 0) for r in "01") >= 1, counts
    # and each engine saw its share, by its own count (through its own SDK client)
    assert all(engine.client.health().stats.prompt_tokens > 0 for engine in engines)


def kv_index(gateway: GatewayOnly, name: str) -> dict[str, float]:
    pattern = rf'actorserve_replica_kv_index_{name}\{{model_name="[^"]*",replica="(\d)"\}} (\S+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, gateway.metrics())}


def test_the_gateway_follows_each_replicas_kv_events_over_curve_and_a_stranger_does_not(
    cluster,
):
    _, _, gateways, _ = cluster
    # each BlockManager publishes on its client port + 1, CURVE with the client socket's keys
    assert wait_until(lambda: kv_index(gateways["right"], "usable") == {"0": 1.0, "1": 1.0}, 30)
    assert sum(kv_index(gateways["right"], "blocks").values()) > 0
    assert kv_index(gateways["stranger"], "usable") == {"0": 0.0, "1": 0.0}


def test_a_gateway_whose_key_no_replica_authorizes_gets_a_503_naming_the_replica_at_once(
    cluster,
):
    addresses, _, gateways, _ = cluster
    started = time.monotonic()
    status, reply = gateways["stranger"].post({"prompt": "Hello there", "max_tokens": 2})
    assert time.monotonic() - started < 10  # under --engine-liveness-timeout-s 20: no wait
    assert status == 503, reply
    message = reply["error"]["message"]
    assert "refused this client's CurveZMQ key" in message, message
    assert any(f"the engine at {address}" in message for address in addresses), message


def test_a_client_holding_another_servers_key_fails_at_once_naming_the_handshake(cluster):
    """What the gateway's SDK client to a replica does with the replica's server keys swapped
    (the failed handshake, not a refusal of the client's key)."""
    addresses, _, _, keys = cluster
    options = client_options(keys["c"]["server_public"], keys["a"]["client_secret"])

    async def ask() -> str:
        async with AsyncClient(addresses[0], liveness_timeout_s=20, **options) as client:
            with pytest.raises(EngineUnavailable) as failure:
                await client.health(timeout_s=20)
            return str(failure.value)

    started = time.monotonic()
    message = asyncio.run(ask())
    assert time.monotonic() - started < 10
    assert message.startswith(f"the engine at {addresses[0]} failed the CurveZMQ handshake")


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()]


def test_a_gateway_only_server_restarts_its_gateway_on_the_same_port(cluster, llama_dir):
    _, _, gateways, _ = cluster
    gateway = gateways["right"]
    (child,) = children(gateway.proc.pid)  # the gateway: no actor runs beside it
    os.kill(child, signal.SIGKILL)
    prompt = prompts_of_lengths(llama_dir, [24])[0]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}

    def served() -> bool:
        try:
            return gateway.post(body, timeout_s=10)[0] == 200
        except OSError:  # refused or reset while the gateway is away
            return False

    deadline = time.monotonic() + 60
    while not served():
        assert time.monotonic() < deadline, gateway.log_path.read_text()
        time.sleep(0.2)
    assert children(gateway.proc.pid) not in ([], [child])
    assert gateway.proc.poll() is None
