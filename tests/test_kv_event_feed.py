"""The gateway's KV event reader against publishers the test plays itself: a `--role gateway`
server routing across two replica addresses where no engine runs, whose events sockets are
XPUBs bound here. Whatever bytes come, the gateway serves on; a gap makes it re-subscribe (the
resync); its index of a replica never holds more than `--route-kv-max-blocks` hashes; the lag
metric is the newest event's age."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
from gateway_support import wait_until

from actorserve.actors.runtime.addresses import kv_events_address
from actorserve.messages.codec import encode
from actorserve.messages.kv_events import AllCleared, BlockStored, KvEventBatch, KvSnapshot

pytestmark = pytest.mark.slow
CAP = 50
BLOCK = 16


class FakeReplicas:
    """Two replica addresses; at each, only an events XPUB (this process's)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="actorserve-kv-feed-")
        self.addresses = [f"ipc://{self.dir}/replica{i}.sock" for i in range(2)]
        self.ctx = zmq.Context()
        self.pubs = []
        for address in self.addresses:
            pub = self.ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(kv_events_address(address))
            self.pubs.append(pub)

    def subscribed(self, i: int, timeout_s: float = 30.0) -> bool:
        """Whether a subscription came to replica i's XPUB within `timeout_s` (taking it)."""
        if not self.pubs[i].poll(timeout_s * 1000):
            return False
        return self.pubs[i].recv()[:1] == b"\x01"

    def send(self, i: int, data: bytes) -> None:
        self.pubs[i].send(data)

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def gateway(llama_dir):
    fakes = FakeReplicas()
    log = open(Path(fakes.dir) / "serve.log", "w")
    cmd = [sys.executable, "-m", "actorserve.cli", "serve", "--role", "gateway"]
    cmd += ["--model", str(llama_dir), "--port", "0", "--replicas", ",".join(fakes.addresses)]
    cmd += ["--route-policy", "kv_events"]
    cmd += ["--route-kv-max-blocks", str(CAP), "--route-kv-message-bytes", "65536"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    match = re.search(r"http://([\d.]+):(\d+)", lines[-1])
    assert match, (lines, (Path(fakes.dir) / "serve.log").read_text())
    proc.url = match.group(0)
    proc.fakes = fakes
    for i in range(2):
        assert fakes.subscribed(i)
    yield proc
    proc.terminate()
    assert proc.wait(60) == 0
    fakes.close()


def metrics(gateway) -> str:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=30) as reply:
        return reply.read().decode()


def per_replica(gateway, name: str) -> dict[str, float]:
    pattern = rf'actorserve_{name}\{{model_name="[^"]*",replica="(\d+)"\}} (\S+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, metrics(gateway))}


def hashes(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(count)]


def hostile_messages(rng: random.Random) -> list[bytes]:
    """Random bytes, msgpack of the wrong shapes, and well-formed messages that lie."""
    out = [rng.randbytes(rng.randrange(0, 300)) for _ in range(300)]
    out += [b"", b"\xc1", b"\x91" * 5000 + b"\x00", b"\xdd\xff\xff\xff\xff"]
    out += [msgspec.msgpack.encode(x) for x in ([1, 2], {"a": 1}, ["KvSnapshot"], None, 1e300)]
    out += [msgspec.msgpack.encode(["KvEventBatch", 0, 0, 0.0, [["Nope"]]])]
    out += [msgspec.msgpack.encode(["KvSnapshot", 0, 0, 0.0, BLOCK, [b"x" * 3, 5]])]
    out += [encode(KvEventBatch(-(2**63), 2**63 - 1, float("nan"), [AllCleared()]))]
    out += [encode(KvSnapshot(0, 0, float("inf"), BLOCK, [b""] * 100))]
    out += [b"\x00" * 70000]  # over --route-kv-message-bytes: ZMQ drops it, and the connection
    return out


def test_any_bytes_on_the_events_socket_leave_the_gateway_serving(gateway):
    rng = random.Random(7)
    for data in hostile_messages(rng):
        gateway.fakes.send(0, data)
    # a well-formed snapshot, sent until it gets through (the oversized message cost the
    # connection: the gateway subscribes again)
    snapshot = encode(KvSnapshot(5, 3, time.time(), BLOCK, hashes(10, 1)))

    def took_it() -> bool:
        gateway.fakes.send(0, snapshot)
        return per_replica(gateway, "replica_kv_index_blocks").get("0") == 10

    assert wait_until(took_it, 60, 0.5)
    assert per_replica(gateway, "replica_kv_index_usable")["0"] == 1.0
    assert gateway.poll() is None


def test_a_gap_in_the_sequence_clears_the_index_and_the_gateway_subscribes_again(gateway):
    gateway.fakes.send(1, encode(KvSnapshot(2, 40, time.time(), BLOCK, hashes(7, 2))))
    assert wait_until(lambda: per_replica(gateway, "replica_kv_index_blocks").get("1") == 7, 30)
    resyncs = per_replica(gateway, "replica_kv_index_resyncs_total")["1"]
    stored = BlockStored(hashes(1, 3), bytes(16), BLOCK)
    gateway.fakes.send(1, encode(KvEventBatch(2, 42, time.time(), [stored])))  # 41 is missing
    assert gateway.fakes.subscribed(1, 10)
    assert per_replica(gateway, "replica_kv_index_resyncs_total")["1"] == resyncs + 1
    assert per_replica(gateway, "replica_kv_index_usable")["1"] == 0.0
    assert per_replica(gateway, "replica_kv_index_blocks")["1"] == 0.0


def test_the_index_stays_under_its_cap(gateway):
    gateway.fakes.send(1, encode(KvSnapshot(3, 0, time.time(), BLOCK, hashes(CAP - 5, 4))))
    assert wait_until(lambda: per_replica(gateway, "replica_kv_index_usable").get("1") == 1, 30)
    more = BlockStored(hashes(3 * CAP, 5), bytes(16), BLOCK)
    gateway.fakes.send(1, encode(KvEventBatch(3, 1, time.time(), [more])))
    assert wait_until(lambda: per_replica(gateway, "replica_kv_index_usable")["1"] == 0, 30)
    assert per_replica(gateway, "replica_kv_index_blocks")["1"] == CAP
    # a new epoch (the replica's cache emptied) makes it whole again
    gateway.fakes.send(1, encode(KvEventBatch(4, 0, time.time(), [AllCleared()])))
    assert wait_until(lambda: per_replica(gateway, "replica_kv_index_usable")["1"] == 1, 30)
    assert per_replica(gateway, "replica_kv_index_blocks")["1"] == 0


def test_the_lag_is_the_age_of_the_newest_event(gateway):
    gateway.fakes.send(1, encode(KvEventBatch(4, 1, time.time() - 100, [AllCleared()])))
    assert wait_until(lambda: per_replica(gateway, "replica_kv_index_lag_seconds")["1"] >= 100, 30)
