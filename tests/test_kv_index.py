"""The pure parts of KV-event routing: the BlockPool's events follow its prefix cache exactly, a
gateway's index of a replica follows the events (and knows when it missed some), and the router
counts what it routed (gateway/kv_index.py, gateway/kv_routing.py; the choice itself:
tests/test_kv_routing.py)."""

from __future__ import annotations

import asyncio
import random

from actorserve.actors.block_manager.block_pool import BlockPool
from actorserve.actors.block_manager.kv_events import KvEventLog
from actorserve.gateway.kv_index import ReplicaIndex
from actorserve.gateway.kv_routing import KvRouter, prompt_block_hashes
from actorserve.gateway.replicas import ReplicaSet
from actorserve.messages.blocks import BlockNeed
from actorserve.messages.client import Delta
from actorserve.messages.codec import Decoder, encode
from actorserve.messages.common import FinishReason
from actorserve.messages.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlockStored,
    KvEventBatch,
    KvEventMessage,
    KvSnapshot,
)

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Replica:
    """A BlockPool whose events go, batch by batch and through the codec, into an index."""

    def __init__(self, num_blocks: int, max_blocks: int = 1 << 20, salt: str | None = None):
        self.pool = BlockPool(num_blocks, BS)
        self.pool.events = KvEventLog(BS)
        self.index = ReplicaIndex(max_blocks, BS)
        self.seq = 0
        self.decoder = Decoder(KvEventMessage)
        self.deliver(KvEventBatch(0, 0, 0.0, [AllCleared()]))
        self.step = 0

    def deliver(self, message) -> bool:
        return self.index.apply(self.decoder.decode(encode(message)))

    def run(self, tokens: list[int], salt: str | None = None) -> str:
        self.step += 1
        rid = f"r{self.step}"
        need = BlockNeed(rid, 0, len(tokens), True, tokens, cache_salt=salt)
        allocation = self.pool.allocate_step([need], epoch=0, step_id=self.step)
        assert allocation.granted
        self.pool.free(rid)
        events = self.pool.events.take()
        if events:
            self.seq += 1
            assert not self.deliver(KvEventBatch(0, self.seq, 1.0, events))
        return rid


def test_the_index_holds_exactly_the_pools_cached_hashes_through_evictions():
    rng = random.Random(0)
    replica = Replica(num_blocks=24)
    prefixes = [[rng.randrange(100) for _ in range(3 * BS)] for _ in range(4)]
    for _ in range(60):
        tail = [rng.randrange(100) for _ in range(rng.randrange(1, 3 * BS))]
        replica.run(rng.choice(prefixes) + tail, salt=rng.choice([None, "a"]))
        assert set(replica.index.blocks) == set(replica.pool.cached)
        assert replica.index.usable
    assert replica.index.resyncs == 0


def test_a_prompt_chain_is_the_one_the_block_manager_looks_up():
    replica = Replica(num_blocks=16)
    prompt = list(range(3 * BS + 1))
    replica.run(prompt, salt="tenant")
    hashes = prompt_block_hashes(prompt, BS, "tenant", max_blocks=8)
    assert len(hashes) == 3
    assert replica.index.cached_prefix_blocks(hashes) == 3
    assert replica.index.cached_prefix_blocks(prompt_block_hashes(prompt, BS, None, 8)) == 0
    # a prompt of exactly 3 blocks leaves its last token to compute: 2 blocks can hit
    assert len(prompt_block_hashes(prompt[: 3 * BS], BS, "tenant", 8)) == 2
    assert len(prompt_block_hashes(prompt, BS, "tenant", max_blocks=1)) == 1


def test_a_sequence_gap_clears_the_index_until_a_snapshot_comes():
    index = ReplicaIndex(100, BS)
    assert not index.usable  # nothing known before a snapshot or an epoch's start
    assert not index.apply(KvEventBatch(3, 0, 1.0, [AllCleared(), BlockStored([h(1)], h(0), BS)]))
    assert index.usable and index.cached_prefix_blocks([h(1)]) == 1
    assert index.apply(KvEventBatch(3, 2, 2.0, [BlockStored([h(2)], h(1), BS)]))  # 1 is missing
    assert not index.usable and not index.blocks and index.resyncs == 1
    # what comes before the snapshot is not applied, and asks for nothing more
    assert not index.apply(KvEventBatch(3, 3, 3.0, [BlockStored([h(3)], h(2), BS)]))
    assert not index.usable and not index.blocks
    assert not index.apply(KvSnapshot(3, 3, 4.0, BS, [h(1), h(2), h(3)]))
    assert index.usable and index.cached_prefix_blocks([h(1), h(2), h(3)]) == 3
    assert not index.apply(KvEventBatch(3, 4, 5.0, [BlocksRemoved([h(2)])]))
    assert index.cached_prefix_blocks([h(1), h(2), h(3)]) == 1
    assert index.newest_ts == 5.0


def test_a_new_epoch_empties_the_index_and_one_not_starting_at_zero_is_a_gap():
    index = ReplicaIndex(100, BS)
    index.apply(KvSnapshot(1, 7, 1.0, BS, [h(1), h(2)]))
    assert not index.apply(KvEventBatch(2, 0, 2.0, [AllCleared()]))  # a restarted BlockManager
    assert index.usable and not index.blocks and index.epoch == 2
    index.apply(KvEventBatch(2, 1, 3.0, [BlockStored([h(5)], h(0), BS)]))
    assert index.apply(KvEventBatch(4, 3, 4.0, [BlockStored([h(6)], h(5), BS)]))
    assert not index.usable and not index.blocks


def test_the_index_stays_under_its_cap_and_is_partial_until_the_cache_is_cleared():
    index = ReplicaIndex(max_blocks=5, block_size=BS)
    index.apply(
        KvEventBatch(0, 0, 1.0, [AllCleared(), BlockStored([h(i) for i in range(8)], h(99), BS)])
    )
    assert len(index.blocks) == 5 and index.partial and not index.usable
    assert set(index.blocks) == {h(i) for i in range(3, 8)}  # the oldest went
    index.apply(KvSnapshot(0, 0, 2.0, BS, [h(i) for i in range(20)]))
    assert len(index.blocks) == 5 and not index.usable
    index.apply(KvEventBatch(1, 0, 3.0, [AllCleared(), BlockStored([h(1)], h(0), BS)]))
    assert index.usable and len(index.blocks) == 1


def test_a_replica_of_another_block_size_is_never_usable():
    index = ReplicaIndex(100, BS)
    index.apply(KvSnapshot(0, 0, 1.0, 2 * BS, [h(1)]))
    assert index.in_step and not index.usable


def test_the_router_is_ready_only_while_every_usable_replica_index_is():
    indexes = [ReplicaIndex(100, BS), ReplicaIndex(100, BS)]
    router = KvRouter(indexes, BS, 64, assume_s=30.0)
    indexes[0].apply(KvSnapshot(0, 0, 1.0, BS, []))
    assert not router.ready([True, True])
    assert router.ready([True, False])  # the one without an index is down
    indexes[1].apply(KvSnapshot(0, 0, 1.0, BS, []))
    assert router.ready([True, True])
    assert (router.by_cache, router.fallbacks) == (2, 1)


def test_a_routed_prompt_counts_as_cached_there_until_its_blocks_are_removed():
    indexes = [ReplicaIndex(100, BS), ReplicaIndex(100, BS)]
    for index in indexes:
        index.apply(KvSnapshot(0, 0, 1.0, BS, []))
    router = KvRouter(indexes, BS, 64, assume_s=30.0)
    hashes = router.hashes(list(range(5 * BS)), None)
    idle = ([True, True], [0, 0], [0, 0], [None, None])
    assert router.choose(hashes, 5 * BS, *idle, affine=0) == 0
    router.routed(1, hashes)  # sent to 1 all the same (say, 0 was loaded)
    assert router.choose(hashes, 5 * BS, *idle, affine=0) == 1
    indexes[1].apply(KvEventBatch(0, 1, 2.0, [BlocksRemoved(hashes[:1])]))
    assert indexes[1].cached_prefix_blocks(hashes) == 0


class SlowClient:
    """Streams two tokens, the first once `release` is set."""

    def __init__(self):
        self.release = asyncio.Event()
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, params, request_id, priority, resume=None, tenant=None):
        self.prompts.append(prompt)
        await self.release.wait()
        yield Delta(request_id, token_ids=[1])
        yield Delta(request_id, token_ids=[2], finish_reason=FinishReason.LENGTH)

    async def close(self):
        pass


def test_a_replica_set_routes_on_the_indexes_and_counts_prefill_until_the_first_token():
    """Replica 1 holds the prompt's 4 blocks; while a request there waits for its first token,
    its uncached prompt tokens count as its queued prefill, and the next one sharing only the
    prefix is weighed against that."""
    prompt = list(range(4 * BS + 1))
    indexes = [ReplicaIndex(100, BS), ReplicaIndex(100, BS)]
    indexes[0].apply(KvSnapshot(0, 0, 1.0, BS, []))
    indexes[1].apply(KvSnapshot(0, 0, 1.0, BS, prompt_block_hashes(prompt, BS, None, 64)))
    router = KvRouter(indexes, BS, 64, assume_s=0.0)
    clients = [SlowClient(), SlowClient()]

    async def run() -> list[int]:
        replicas = ReplicaSet(clients, BS, 1, 4, 60.0, policy="kv_events", kv=router)
        long_tail = prompt + list(range(1000, 1000 + 10 * BS))  # 10 blocks not cached anywhere
        first = asyncio.ensure_future(drain(replicas.generate(long_tail)))
        await asyncio.sleep(0.05)
        held = (replicas.replicas[1].awaiting_first, replicas.replicas[1].prefill_here)
        second = asyncio.ensure_future(drain(replicas.generate(prompt)))
        await asyncio.sleep(0.05)
        for client in clients:
            client.release.set()
        await asyncio.gather(first, second)
        after = [(r.awaiting_first, r.prefill_here, r.in_flight) for r in replicas.replicas]
        return [held, after]

    held, after = asyncio.run(run())
    assert len(clients[1].prompts[0]) == 14 * BS + 1  # the long one went to the cache
    assert held == (1, 10 * BS + 1)  # its prompt less the 4 cached blocks
    # 4 cached blocks there do not outweigh 10 queued blocks of prefill: the other replica
    assert clients[0].prompts == [prompt]
    assert after == [(0, 0, 0), (0, 0, 0)]


async def drain(stream) -> None:
    async for _ in stream:
        pass
