"""The gateway's replica routing (gateway/replicas.py, replica_choice.py), without processes:
prefix keys, the rendezvous choice against load, replicas that are down, and a stream's failover
as a resumption."""

from __future__ import annotations

import asyncio
import random

import pytest

from actorserve.gateway.errors import EngineError, EngineUnavailable
from actorserve.gateway.replica_choice import (
    choose_replica,
    next_in_turn,
    prefix_key,
    replica_load,
)
from actorserve.gateway.replicas import ReplicaSet, sum_stats
from actorserve.gateway.request_stream import RequestStream
from actorserve.messages.client import (
    Delta,
    EngineStats,
    GenerateRequest,
    HealthReply,
    ResumedSample,
)
from actorserve.messages.common import FinishReason, SamplingParams

BLOCK = 16
LENGTH = FinishReason.LENGTH


def test_prompts_under_one_block_have_no_prefix_key():
    assert prefix_key(list(range(BLOCK - 1)), BLOCK, 4) is None
    assert prefix_key(list(range(BLOCK)), BLOCK, 4) is not None


def test_prefix_key_is_the_first_full_blocks_only():
    shared = list(range(4 * BLOCK))
    assert prefix_key(shared + [1, 2, 3], BLOCK, 4) == prefix_key(shared + [9] * 40, BLOCK, 4)
    assert prefix_key(shared, BLOCK, 4) != prefix_key(shared[:-1] + [7], BLOCK, 4)
    # past max_blocks the prompt no longer matters; within them every block does
    assert prefix_key(shared, BLOCK, 2) == prefix_key(shared[: 2 * BLOCK] + [5] * 30, BLOCK, 2)


def keys(count: int) -> list[bytes]:
    rng = random.Random(7)
    return [prefix_key([rng.randrange(1000) for _ in range(BLOCK)], BLOCK, 4) for _ in range(count)]


def test_affinity_is_stable_and_spreads_keys_over_the_replicas():
    chosen = [choose_replica(k, [0, 0, 0], [True] * 3, 4) for k in keys(300)]
    assert chosen == [choose_replica(k, [0, 0, 0], [True] * 3, 4) for k in keys(300)]
    assert all(chosen.count(i) > 60 for i in range(3))


def test_a_replica_leaving_moves_only_its_own_keys():
    before = [choose_replica(k, [0, 0, 0], [True] * 3, 4) for k in keys(200)]
    after = [choose_replica(k, [0, 0, 0], [True, False, True], 4) for k in keys(200)]
    assert all(a == b for a, b in zip(before, after, strict=True) if a != 1)
    assert 1 not in after


def test_load_margin_is_respected():
    key = keys(1)[0]
    affine = choose_replica(key, [0, 0], [True, True], 2)
    other = 1 - affine
    loads = [0, 0]
    loads[affine] = 2  # two above the least loaded: within the margin
    assert choose_replica(key, loads, [True, True], 2) == affine
    loads[affine] = 3  # three above: the least loaded takes it
    assert choose_replica(key, loads, [True, True], 2) == other
    loads[other] = 1  # back within the margin of it
    assert choose_replica(key, loads, [True, True], 2) == affine


def test_without_a_key_the_least_loaded_usable_replica_is_chosen():
    assert choose_replica(None, [3, 1, 2], [True, True, True], 0) == 1
    assert choose_replica(None, [3, 1, 2], [True, False, True], 0) == 2
    assert choose_replica(None, [0, 0], [False, False], 0) is None


def test_a_replica_over_kv_high_is_skipped_for_affinity_and_load_unless_all_are():
    key = keys(1)[0]
    affine = choose_replica(key, [0, 0], [True, True], 2)
    other = 1 - affine
    kv = [0.0, 0.0]
    kv[affine] = 0.95
    assert choose_replica(key, [0, 0], [True, True], 2, kv, 0.9) == other
    assert choose_replica(None, [0, 5], [True, True], 0, [0.95, 0.5], 0.9) == 1  # not the idle one
    assert choose_replica(key, [0, 0], [True, True], 2, [0.95, 0.97], 0.9) == affine  # all full
    kv[affine] = 0.9  # at the mark, not over it
    assert choose_replica(key, [0, 0], [True, True], 2, kv, 0.9) == affine


def test_load_is_the_larger_of_requests_in_flight_here_and_the_replicas_own_count():
    assert replica_load(3, None) == 3
    assert replica_load(3, EngineStats(num_running=1, num_waiting=1)) == 3
    # other gateways' requests count: the replica's own running + waiting
    assert replica_load(1, EngineStats(num_running=4, num_waiting=6)) == 10


def test_round_robin_takes_the_usable_replicas_in_turn():
    assert next_in_turn(-1, [True, True, True]) == 0
    assert next_in_turn(0, [True, True, True]) == 1
    assert next_in_turn(2, [True, True, True]) == 0
    assert next_in_turn(0, [True, False, True]) == 2
    assert next_in_turn(1, [False, False]) is None


def test_a_resumed_request_stream_starts_with_its_tokens_and_finished_samples():
    request = GenerateRequest(
        "r", prompt_token_ids=[1, 2], params=SamplingParams(n=3), resume=[ResumedSample(1, [5])]
    )
    stream = RequestStream(request)
    assert (stream.unfinished, stream.finished, stream.done) == (1, 2, {0, 2})
    stream.push(Delta("r", token_ids=[6], index=1))
    assert stream.resumption().resume == [ResumedSample(1, [5, 6])]


class FakeClient:
    """Streams `tokens` one per delta; with `die_after`, fails as unavailable after that many."""

    def __init__(
        self, tokens: list[int], die_after: int | None = None, stats: EngineStats | None = None
    ):
        self.tokens = tokens
        self.die_after = die_after
        self.stats = stats  # what health answers (None: it fails)
        self.requests: list[tuple[list[int], list[ResumedSample] | None]] = []
        self.tenants: list[str | None] = []
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id, priority, resume=None, tenant=None):
        self.requests.append((prompt, resume))
        self.tenants.append(tenant)
        start = len(resume[0].output_token_ids) if resume else 0
        for i, token in enumerate(self.tokens[start:], start):
            if self.die_after is not None and i >= self.die_after:
                raise EngineUnavailable("gone")
            last = i == len(self.tokens) - 1
            yield Delta(request_id, token_ids=[token], finish_reason=LENGTH if last else None)

    async def health(self, timeout_s):
        if self.stats is None:
            raise EngineUnavailable("gone")
        return HealthReply("h", ok=True, stats=self.stats)

    async def abort(self, request_id):
        self.aborted.append(request_id)


def test_a_stream_whose_replica_dies_resumes_on_another_with_its_tokens_and_tenant():
    tokens = [11, 12, 13, 14, 15]
    dying, healthy = FakeClient(tokens, die_after=2), FakeClient(tokens)

    async def run() -> tuple[list[int], ReplicaSet]:
        replicas = ReplicaSet([dying, healthy], BLOCK, 4, 4, 60.0)
        stream = replicas.generate([1, 2], SamplingParams(), "r", tenant="key:0")
        out = [t async for d in stream for t in d.token_ids]
        return out, replicas

    out, replicas = asyncio.run(run())
    assert out == tokens
    assert healthy.requests == [([1, 2], [ResumedSample(0, [11, 12])])]
    assert dying.tenants == healthy.tenants == ["key:0"]  # its client's share on either
    assert [r.up for r in replicas.replicas] == [False, True]
    assert [r.in_flight for r in replicas.replicas] == [0, 0]


def test_an_abort_goes_to_the_replica_streaming_the_request_else_to_every_replica():
    first, second = FakeClient([1, 2, 3]), FakeClient([1, 2, 3])

    async def run() -> ReplicaSet:
        replicas = ReplicaSet([first, second], BLOCK, 4, 4, 60.0)
        stream = replicas.generate([1], SamplingParams(), "r")
        await anext(stream)  # under way on the least loaded: the first
        await replicas.abort("r")
        await stream.aclose()
        await replicas.abort("ended")  # no replica streams it now
        return replicas

    replicas = asyncio.run(run())
    assert (first.aborted, second.aborted) == (["r", "ended"], ["ended"])
    assert replicas.serving == {}


def test_with_no_replica_left_the_failure_is_raised():
    async def run() -> None:
        replicas = ReplicaSet([FakeClient([1, 2, 3], die_after=1)], BLOCK, 4, 4, 60.0)
        async for _ in replicas.generate([1], SamplingParams(), "r"):
            pass

    with pytest.raises(EngineError):
        asyncio.run(run())


def test_replica_stats_add_up():
    total = sum_stats([EngineStats(num_running=2, blocks_total=10), EngineStats(num_running=1)])
    assert (total.num_running, total.blocks_total) == (3, 10)


def test_requests_are_routed_on_the_replicas_polled_load_and_kv_use():
    """The affine replica is busy with another gateway's requests (its own running + waiting),
    then its KV cache is full: once a stats poll has seen it, requests go to the other."""
    key = keys(1)[0]
    affine = choose_replica(key, [0, 0], [True, True], 2)
    idle = EngineStats(blocks_total=100, blocks_free=100)
    clients = [FakeClient([1], stats=idle), FakeClient([1], stats=idle)]

    async def route(stats: EngineStats) -> tuple[int, int]:
        clients[affine].stats = stats
        replicas = ReplicaSet(clients, BLOCK, 4, 2, 60.0, stats_interval_s=0.05)
        before = replicas.choose(key).index  # no stats yet: in flight here only
        await asyncio.sleep(0.1)  # the poll this choice started has answered
        return before, replicas.choose(key).index

    busy = EngineStats(num_running=2, num_waiting=6, blocks_total=100, blocks_free=90)
    assert asyncio.run(route(busy)) == (affine, 1 - affine)
    full = EngineStats(blocks_total=100, blocks_free=4)
    assert asyncio.run(route(full)) == (affine, 1 - affine)
    assert asyncio.run(route(idle)) == (affine, affine)


def test_round_robin_policy_alternates_whatever_the_prefix():
    key = keys(1)[0]

    async def route() -> list[int]:
        clients = [FakeClient([1]), FakeClient([1])]
        replicas = ReplicaSet(clients, BLOCK, 4, 2, 60.0, policy="round_robin")
        return [replicas.choose(key).index for _ in range(4)]

    assert asyncio.run(route()) == [0, 1, 0, 1]
