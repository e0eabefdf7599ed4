"""`--route-policy kv_events` across `--data-parallel-size 2`: the gateway routes on what each
replica's BlockManager says its prefix cache holds (its KV events), not on a guess.

Each test first serves a prefix on the replica that prefix affinity would *not* pick, straight
through the SDK (so the gateway has no say), and waits until that replica's events are newer
than the request: then a request sharing the prefix can only land there by the events. The
cache is small (48 blocks), so that a replica evicts. The replicas' step costs are priced alike
(a --route-kv-tie no measure on a busy machine exceeds), so that where no replica holds a
prompt's blocks and both are idle the work is the same on both, and it goes to prefix
affinity's pick (tests/test_kv_routing.py weighs load and costs). One server for the module;
the BlockManager SIGKILL test runs last.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from gateway_support import GatewayServer, call, wait_until

from actorserve import Client
from actorserve.gateway.replica_choice import choose_replica, prefix_key
from actorserve.messages.common import SamplingParams
from support import pids_with_command_line, prompts_of_lengths

pytestmark = pytest.mark.slow
BLOCK = 16
NUM_KV_BLOCKS = 48
FLAGS = (
    "--data-parallel-size", "2",
    "--torch-threads", "1",  # one core per replica on this 2-core machine
    "--route-policy", "kv_events",
    "--route-kv-tie", "100",  # the replicas' step costs priced alike, however noisy here
    "--num-kv-blocks", str(NUM_KV_BLOCKS),
    "--max-model-len", "256",
    "--health-interval-s", "0.5",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(llama_dir):
    server = GatewayServer(llama_dir, *FLAGS)
    line = server._read_line(30)
    match = re.fullmatch(r"actorserve: replica 1 at (ipc://\S+/client\.sock)\n?", line)
    assert match, line
    server.replicas = [server.address, match.group(1)]
    server.sdk = [Client(address, timeout_s=120) for address in server.replicas]
    assert wait_until(lambda: per_replica(server, "replica_kv_index_usable") == both(1.0), 30)
    yield server
    for client in server.sdk:
        client.close()
    assert server.stop() == 0


def both(value: float) -> dict[str, float]:
    return {"0": value, "1": value}


def per_replica(server, name: str) -> dict[str, float]:
    text = call(server, "GET", "/metrics").body.decode()
    pattern = rf'actorserve_{name}\{{model_name="[^"]*",replica="(\d+)"\}} (\S+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text)}


def routed_delta(server, before: dict[str, float]) -> dict[str, float]:
    after = per_replica(server, "replica_requests_routed_total")
    return {r: after[r] - before.get(r, 0) for r in ("0", "1")}


def not_affine(prompt: list[int]) -> int:
    """The replica prefix affinity would not send `prompt` to (the gateway's default
    route_prefix_blocks, 4, and margin)."""
    affine = choose_replica(prefix_key(prompt, BLOCK, 4), [0, 0], [True, True], 4)
    return 1 - affine


def serve_directly(server, replica: int, prompt: list[int]) -> None:
    """Run `prompt` on `replica` through the SDK, and wait until the gateway has that replica's
    events from after it started."""
    started = time.time()
    server.sdk[replica].complete(prompt, SamplingParams(max_tokens=1, temperature=0))
    assert wait_until(
        lambda: (
            per_replica(server, "replica_kv_index_lag_seconds")[str(replica)]
            <= time.time() - started
        ),
        10,
    )


def complete(server, prompt: list[int]) -> None:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    reply = call(server, "POST", "/v1/completions", body)
    assert reply.status == 200, reply.body


def texts(llama_dir, count: int, length: int, offset: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, none sharing a first block with another test's."""
    lengths = [length] * (count + offset)
    return prompts_of_lengths(llama_dir, lengths)[offset:]


def test_a_request_goes_to_the_replica_whose_cache_holds_its_prefix(server, llama_dir):
    prefix, first, second = texts(llama_dir, 3, 8 * BLOCK, offset=0)
    x = not_affine(prefix)
    serve_directly(server, x, prefix + first[:9])
    before = per_replica(server, "replica_requests_routed_total")
    complete(server, prefix + second[:9])
    assert routed_delta(server, before) == {str(x): 1, str(1 - x): 0}


def test_the_index_follows_the_replicas_evictions(server, llama_dir):
    prefix, tail, *flood = texts(llama_dir, 2 + 8, 12 * BLOCK, offset=3)
    x = not_affine(prefix)
    serve_directly(server, x, prefix + tail[:5])
    # 8 prompts of 12 blocks, none sharing a block: every block cached before is handed out
    # again, so the prefix's blocks are evicted
    for other in flood:
        serve_directly(server, x, other)
    assert per_replica(server, "replica_kv_index_blocks")[str(x)] <= NUM_KV_BLOCKS
    before = per_replica(server, "replica_requests_routed_total")
    complete(server, prefix + tail[5:20])
    # held nowhere now: prefix affinity's pick, the other replica
    assert routed_delta(server, before) == {str(x): 0, str(1 - x): 1}


def block_manager_pid(address: str) -> int:
    """The BlockManager process of the replica at `address` (its config, on its command
    line, names the address)."""
    pids = pids_with_command_line(address.encode(), b"block_manager.block_manager")
    assert len(pids) == 1, pids
    return pids[0]


def test_a_block_manager_restart_clears_its_index_routing_falls_back_then_recovers(
    server, llama_dir
):
    prefix, tail, again, other, other_tail = texts(llama_dir, 5, 8 * BLOCK, offset=13)
    x = not_affine(prefix)
    serve_directly(server, x, prefix + tail[:9])
    resyncs = per_replica(server, "replica_kv_index_resyncs_total")[str(x)]
    fallbacks = kv_routed(server)["fallback"]
    busy = threading.Event()

    def keep_routing() -> None:  # requests routed while the index is out of step fall back
        for i in range(1000):
            if busy.is_set():
                return
            complete(server, again[i % 64 : i % 64 + 4])

    senders = [threading.Thread(target=keep_routing) for _ in range(3)]
    for sender in senders:
        sender.start()
    try:
        time.sleep(0.3)
        os.kill(block_manager_pid(server.replicas[x]), signal.SIGKILL)
        assert wait_until(
            lambda: per_replica(server, "replica_kv_index_resyncs_total")[str(x)] > resyncs, 30
        )
        assert wait_until(lambda: per_replica(server, "replica_kv_index_usable") == both(1.0), 60)
    finally:
        busy.set()
        for sender in senders:
            sender.join(120)
    assert kv_routed(server)["fallback"] > fallbacks
    # the restarted BlockManager's cache is empty, and the index says so: the prefix it held
    # goes where prefix affinity sends it
    before = per_replica(server, "replica_requests_routed_total")
    complete(server, prefix + again[:9])
    assert routed_delta(server, before) == {str(x): 0, str(1 - x): 1}
    # and its new events are followed again
    y = not_affine(other)
    serve_directly(server, y, other + other_tail[:9])
    before = per_replica(server, "replica_requests_routed_total")
    complete(server, other + other_tail[9:20])
    assert routed_delta(server, before) == {str(y): 1, str(1 - y): 0}


def kv_routed(server) -> dict[str, float]:
    text = call(server, "GET", "/metrics").body.decode()
    pattern = r'actorserve_gateway_kv_routed_total\{model_name="[^"]*",way="(\w+)"\} (\S+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text)}
