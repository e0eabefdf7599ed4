"""A fresh CPU KV cache is faulted in while the Worker has no step to run (KVCache.prefault,
EngineConfig.kv_cache_prefault), lowest blocks first and a chunk at a time, without changing a
byte; so the steps of a fresh server do not pay for first touches."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from test_huge_pages import resident_mib as resident

from actorserve.actors.worker.kv_cache import KVCache
from actorserve.kernels.cpu import huge_pages
from actorserve.messages.common import SamplingParams
from support import EngineServer, generate_concurrently

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/smaps"
)

MIB = 1 << 20


def lazy_cache(num_blocks: int = 512, layers: int = 3) -> KVCache:
    """A cache as the CPU fast path allocates it: untouched pages (16 KiB a block and layer)."""
    return KVCache(
        layers, num_blocks, 0, 16, 8, 64, torch.bfloat16, torch.device("cpu"),
        allocate=lambda shape, dtype: huge_pages.zeros(shape, dtype),
    )  # fmt: skip


def resident_mib(cache: KVCache) -> list[float]:
    """Resident MiB of each layer's K and V."""
    return [resident(t.data_ptr(), t.nbytes) for kv in cache.layers for t in kv]


def test_prefault_walks_every_layer_lowest_blocks_first_and_keeps_the_contents():
    cache = lazy_cache()  # 8 MiB a tensor
    cache.layers[1][0][5].fill_(1.5)  # a step wrote block 5 of layer 1's K
    chunks = cache.prefault(chunk_bytes=2 * MIB)
    next(chunks)
    if resident_mib(cache)[0] == 0:
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    first = resident_mib(cache)
    assert all(2 <= mib <= 2.5 for mib in first), first  # the first chunk of every K and V
    assert sum(1 for _ in chunks) == 3  # 8 MiB in chunks of 2
    assert all(mib >= 8 for mib in resident_mib(cache))
    assert (cache.layers[1][0][5] == 1.5).all()
    assert (
        cache.layers[1][0][:5].count_nonzero() == 0 and cache.layers[1][0][6:].count_nonzero() == 0
    )
    assert list(cache.prefault()) == []  # done once


def test_a_cache_torch_zeroed_has_nothing_to_fault_in():
    cache = KVCache(2, 64, 0, 16, 2, 64, torch.float32, torch.device("cpu"))
    assert list(cache.prefault()) == []


def worker_rss_mib(server: EngineServer) -> float:
    pid = next(a.pid for a in server.client.health().actors if a.name == "worker")
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no Rss line")


def test_a_served_worker_faults_its_cache_in_while_idle_and_serves_the_same_tokens(demo_dir):
    """Two fresh servers with a 256 MiB KV cache, prefault on and off: the first's Worker holds
    its cache in memory within seconds of starting, with no request; the other's holds only
    what its steps wrote. Both give the same greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["def fibonacci(n):", "class Stack:"]
    rss, tokens = {}, {}
    for prefault in ("true", "false"):
        server = EngineServer(
            demo_dir, "--kv-cache-memory-gb", "0.25", "--kv-cache-prefault", prefault
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the Worker stops growing
                before = worker_rss_mib(server)
                time.sleep(1.0)
                if worker_rss_mib(server) - before < 1:
                    break
            rss[prefault] = worker_rss_mib(server)
            outputs = generate_concurrently(server.address, prompts, params)
            tokens[prefault] = [ids for _, ids, _ in outputs]
        finally:
            assert server.stop() == 0
    assert rss["true"] - rss["false"] >= 200, rss  # of the cache's 256 MiB
    assert tokens["true"] == tokens["false"]
