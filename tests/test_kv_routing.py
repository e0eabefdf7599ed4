"""The kv_events choice (gateway/kv_routing.py): the replica where a request is predicted to add
the least to all latencies, its own first token first, from what its cache holds, its queue, the
rows decoding there and its measured step costs; and the queue the gateway counts for a replica
(gateway/replica_state.py), live between two polls of its stats. No processes: the replica
clients are fakes."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.gateway.kv_index import ReplicaIndex
from actorserve.gateway.kv_routing import (
    Decoding,
    KvRouter,
    added_latency,
    choose_by_latency,
    predicted_ttft,
    priced,
    prompt_block_hashes,
)
from actorserve.gateway.replica_state import Replica
from actorserve.gateway.replicas import ReplicaSet
from actorserve.messages.client import Delta, EngineStats, StepCost
from actorserve.messages.common import FinishReason, SamplingParams
from actorserve.messages.kv_events import KvSnapshot

BS = 16
BOTH = [True, True]
# a replica (made up) where a prefill token costs 5 decode rows, and a step 5 prefill tokens
MEASURED = StepCost(step_s=0.05, prefill_token_s=0.01, decode_row_s=0.002, steps=100)


def route(uncached, queues, decodes, costs, tie=0.25, affine=0):
    return choose_by_latency(uncached, queues, decodes, costs, [True] * len(uncached), tie, affine)


def burst(count: int, uncached: list[int], costs, affine=0) -> list[int]:
    """Route `count` requests at once (each counted in its replica's queue as it goes, as the
    gateway does); how many went to each replica."""
    queues, taken = [0] * len(uncached), [0] * len(uncached)
    for _ in range(count):
        i = route(uncached, queues, [0] * len(uncached), costs, affine=affine)
        queues[i] += uncached[i]
        taken[i] += 1
    return taken


def test_the_prediction_is_the_queue_and_the_prompt_then_every_step_with_its_decodes():
    cost = StepCost(step_s=0.05, prefill_token_s=0.01, decode_row_s=0.002, token_budget=1000)
    # 100 queued + 20 of its own: one step, which also runs the 10 decodes
    assert predicted_ttft(cost, 100, 20, 10) == pytest.approx(1.2 + 0.05 + 10 * 0.002)
    # 2500 tokens at most 990 a step (the decodes take 10 of each): 3 steps
    assert predicted_ttft(cost, 2480, 20, 10) == pytest.approx(25.0 + 3 * (0.05 + 0.02))


def test_a_decoding_replica_first_finishes_the_steps_under_way():
    cost = StepCost(step_s=0.05, prefill_token_s=0.01, decode_row_s=0.002, token_budget=1000)
    step = 0.05 + 10 * 0.002
    assert predicted_ttft(cost, 0, 20, 10, steps_ahead=1.5) == pytest.approx(0.2 + 2.5 * step)
    assert predicted_ttft(cost, 0, 20, 0, steps_ahead=1.5) == pytest.approx(0.2 + 0.05)  # idle


def test_steps_under_way_weigh_a_decoding_replica_against_an_idle_one_holding_less():
    """Replica 0 holds 4 more blocks of the prompt (64 tokens: 0.64 s of prefill here). With 8
    decodes (a step of 66 ms), even counting the 1.5 steps under way there, the idle replica is
    slower; with 150 (350 ms a step) it is faster, once the steps under way count."""
    costs = [MEASURED, MEASURED]
    assert choose_by_latency([10, 74], [0, 0], [8, 0], costs, BOTH, steps_ahead=1.5) == 0
    assert choose_by_latency([10, 74], [0, 0], [150, 0], costs, BOTH, steps_ahead=0.0) == 0
    assert choose_by_latency([10, 74], [0, 0], [150, 0], costs, BOTH, steps_ahead=1.5) == 1


def test_with_equal_caches_a_burst_of_requests_spreads_evenly():
    assert burst(8, [24, 24], [MEASURED, MEASURED]) == [4, 4]
    assert burst(9, [24, 24, 24], [MEASURED] * 3) == [3, 3, 3]


def test_with_no_measurements_yet_the_prior_spreads_the_first_requests():
    """Eight new prompts (cached nowhere) whose prefix affinity all picks replica 0."""
    assert burst(8, [200, 200], [None, None]) == [4, 4]


def test_a_replica_holding_a_32_block_prefix_wins_while_its_queue_is_short():
    prompt = 32 * BS + 18
    uncached = [18, prompt]  # replica 0 holds the prefix; replica 1 is idle and holds nothing
    costs = [MEASURED, MEASURED]
    assert route(uncached, [0, 0], [0, 0], costs, affine=1) == 0
    assert route(uncached, [200, 0], [8, 0], costs, affine=1) == 0
    # its queued prefill outweighs the 512 tokens the cache saves: the idle one
    assert route(uncached, [600, 0], [8, 0], costs, affine=0) == 1


def test_a_cached_prefix_is_worth_less_where_a_prefill_token_is_cheap():
    """The same queues: the cache wins where prefill is dear, the idle replica where a step's
    decodes cost more than the prefill the cache saves."""
    uncached, queues, decodes = [18, 32 * BS + 18], [0, 0], [48, 0]
    dear = StepCost(step_s=0.02, prefill_token_s=0.005, decode_row_s=0.001, steps=100)
    cheap = StepCost(step_s=0.02, prefill_token_s=0.00002, decode_row_s=0.001, steps=100)
    assert route(uncached, queues, decodes, [dear, dear], affine=1) == 0
    assert route(uncached, queues, decodes, [cheap, cheap], affine=0) == 1


def test_running_decodes_count_in_every_step_the_prefill_waits_for():
    costs = [MEASURED, MEASURED]
    assert route([24, 24], [0, 0], [60, 0], costs) == 1
    assert route([24, 24], [0, 0], [2, 0], costs) == 1
    assert route([24, 24], [0, 0], [2, 2], costs, affine=1) == 1  # equal: prefix affinity's


def test_replicas_measured_alike_within_the_tie_are_priced_alike_beyond_it_each_by_its_own():
    slower = StepCost(step_s=0.06, prefill_token_s=0.012, decode_row_s=0.002, steps=100)
    costs = [MEASURED, slower]  # replica 1 measured 20% slower: noise, under a tie of 25%
    assert route([100, 100], [0, 0], [0, 0], costs, tie=0.25, affine=1) == 1
    assert route([100, 100], [0, 0], [0, 0], costs, tie=0.1, affine=1) == 0
    # alike, the work decides alone: one token more queued on the faster one
    assert route([100, 100], [1, 0], [0, 0], costs, tie=0.25, affine=0) == 1
    # a replica twice as slow is not noise: it loses with less work queued
    twice = StepCost(step_s=0.1, prefill_token_s=0.02, decode_row_s=0.004, steps=100)
    assert route([100, 100], [50, 0], [0, 0], [MEASURED, twice], affine=1) == 0


def test_a_replica_not_measured_yet_is_priced_like_the_measured_ones():
    """Not by the prior, which could price it out of ever running a step."""
    other = StepCost(step_s=0.07, prefill_token_s=0.02, decode_row_s=0.004, steps=10)
    mean = priced([MEASURED, None, other])[1]
    assert (mean.step_s, mean.prefill_token_s, mean.decode_row_s) == pytest.approx(
        (0.06, 0.015, 0.003)
    )
    unmeasured = priced([MEASURED, StepCost()])[1]
    assert (unmeasured.step_s, unmeasured.prefill_token_s, unmeasured.decode_row_s) == (
        MEASURED.step_s,
        MEASURED.prefill_token_s,
        MEASURED.decode_row_s,
    )
    assert priced([None, None]) == [StepCost(), StepCost()]
    dear = StepCost(step_s=5.0, prefill_token_s=1.0, decode_row_s=1.0, steps=100)
    # priced like the dear one, not at the cheap prior: equal, so prefix affinity's pick
    assert route([100, 100], [0, 0], [0, 0], [dear, None], affine=0) == 0


def test_replicas_down_or_over_kv_high_are_skipped():
    costs = [MEASURED, MEASURED]
    assert choose_by_latency([1, 500], [0, 0], [0, 0], costs, [False, True]) == 1
    assert (
        choose_by_latency([1, 500], [0, 0], [0, 0], costs, BOTH, 0.0, None, [0.95, 0.1], 0.9) == 1
    )
    both_full = [0.95, 0.95]  # none under kv_high: every usable one is a candidate
    assert choose_by_latency([1, 500], [0, 0], [0, 0], costs, BOTH, 0.0, None, both_full, 0.9) == 0
    assert choose_by_latency([1, 1], [0, 0], [0, 0], costs, [False, False]) is None


def test_the_router_prices_what_each_replica_holds_of_the_prompt():
    prompt = list(range(32 * BS + 18))
    indexes = [ReplicaIndex(1000, BS), ReplicaIndex(1000, BS)]
    indexes[0].apply(KvSnapshot(0, 0, 1.0, BS, []))
    held = prompt_block_hashes(prompt[: 32 * BS + 1], BS, None, 64)  # 32 blocks
    indexes[1].apply(KvSnapshot(0, 0, 1.0, BS, held))
    router = KvRouter(indexes, BS, 64, assume_s=0.0, tie=0.25)
    hashes = router.hashes(prompt, None)
    assert [router.uncached(i, hashes, len(prompt)) for i in (0, 1)] == [len(prompt), 18]
    costs = [MEASURED, MEASURED]
    assert router.choose(hashes, len(prompt), BOTH, [0, 0], [0, 0], costs, affine=0) == 1
    assert router.choose(hashes, len(prompt), BOTH, [0, 900], [0, 0], costs, affine=1) == 0


# -- the queue the gateway counts for a replica --------------------------------------------------


def replica(in_flight=0, awaiting=0, prefill=0, prompt=0) -> Replica:
    r = Replica(0, None)
    r.in_flight, r.awaiting_first, r.prefill_here, r.prompt_here = (
        in_flight,
        awaiting,
        prefill,
        prompt,
    )
    return r


def test_requests_routed_since_the_last_stats_count_at_once():
    r = replica()
    r.observe(EngineStats())  # idle when asked
    r.in_flight, r.awaiting_first, r.prefill_here, r.prompt_here = 3, 3, 120, 300
    assert r.queue(60.0) == (120, 0)


def test_stats_taken_before_its_requests_ended_do_not_keep_a_replica_busy():
    r = replica(in_flight=4, awaiting=2, prefill=80, prompt=200)
    r.asking()
    r.observe(EngineStats(num_running=4, prefill_tokens_queued=200))
    r.in_flight = r.awaiting_first = r.prefill_here = r.prompt_here = 0  # all ended since
    assert r.queue(60.0) == (0, 0)


def test_a_request_that_came_and_went_between_the_ask_and_the_answer_is_not_anothers():
    r = replica()
    r.asking()
    r.routed, r.prompt_routed = 1, 60  # routed after the ask, and ended before the answer
    r.observe(EngineStats(num_running=1, prefill_tokens_queued=60))
    assert r.queue(60.0) == (0, 0)


def test_other_gateways_requests_count_from_the_replicas_stats_until_they_go_stale():
    r = replica(in_flight=2, awaiting=1, prefill=40, prompt=100)
    r.asking()
    r.observe(EngineStats(num_running=4, num_waiting=1, prefill_tokens_queued=300))
    assert r.queue(60.0) == (40 + 200, 1 + 3)
    r.stats_at -= 120.0
    assert r.queue(60.0) == (40, 1)  # stale: this gateway's own alone


def test_a_replica_keeps_its_measured_costs_and_a_replacement_forgets_them():
    r = replica()
    r.observe(EngineStats(step_cost=MEASURED))
    r.observe(EngineStats(step_cost=StepCost()))  # a report of no steps: nothing new
    assert r.step_cost == MEASURED
    r.forget()
    assert r.step_cost is None and r.stats is None


class HeldClient:
    """Streams one token once `release` is set; records the prompts it was sent."""

    def __init__(self):
        self.release = asyncio.Event()
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, params, request_id, priority, resume=None, tenant=None):
        self.prompts.append(prompt)
        await self.release.wait()
        yield Delta(request_id, token_ids=[1], finish_reason=FinishReason.LENGTH)

    async def close(self):
        pass


def test_a_burst_sharing_a_prefix_both_replicas_hold_spreads_between_two_polls_of_stats():
    """Eight requests arrive at once, after stats that said both replicas were idle: each one
    routed counts in its replica's queue at once, so they do not all go to one."""
    system = list(range(6 * BS))
    prompts = [system + list(range(1000 + 100 * i, 1000 + 100 * i + 24)) for i in range(8)]
    held = prompt_block_hashes(system + [0], BS, None, 64)
    indexes = [ReplicaIndex(1000, BS), ReplicaIndex(1000, BS)]
    for index in indexes:
        index.apply(KvSnapshot(0, 0, 1.0, BS, held))
    router = KvRouter(indexes, BS, 64, assume_s=0.0, tie=0.25)
    clients = [HeldClient(), HeldClient()]

    async def run() -> None:
        replicas = ReplicaSet(clients, BS, 4, 4, 60.0, policy="kv_events", kv=router)
        for r in replicas.replicas:
            r.observe(EngineStats(step_cost=MEASURED))
        streams = [asyncio.ensure_future(drain(replicas.generate(p))) for p in prompts]
        await asyncio.sleep(0.05)
        for client in clients:
            client.release.set()
        await asyncio.gather(*streams)

    asyncio.run(run())
    assert [len(c.prompts) for c in clients] == [4, 4]


async def drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_load_margin_keeps_a_hot_prefix_from_piling_onto_the_replica_that_holds_it():
    """Replica 0 holds 4 more blocks of the prompt and runs 3 more requests: the prediction
    picks it; with route_kv_load_margin 2 (3 > 0 + 2) the idle replica takes the request."""
    costs = [MEASURED, MEASURED]
    assert choose_by_latency([10, 74], [0, 0], [3, 0], costs, BOTH, loads=[3, 0]) == 0
    assert (
        choose_by_latency([10, 74], [0, 0], [3, 0], costs, BOTH, loads=[3, 0], load_margin=3) == 0
    )
    assert (
        choose_by_latency([10, 74], [0, 0], [3, 0], costs, BOTH, loads=[3, 0], load_margin=2) == 1
    )


def test_a_request_adds_its_first_token_its_decode_steps_and_the_steps_it_slows():
    cost = StepCost(step_s=0.05, prefill_token_s=0.01, decode_row_s=0.002, token_budget=1000)
    # 2 rows there: one with 4 tokens left, one of another gateway's (outlasts it); 10 out tokens
    decoding = Decoding(tokens_left=(4,), unknown=1)
    shared = 4 + 9  # row-steps beside its 9 decode steps
    ttft = predicted_ttft(cost, 0, 20, 2)
    own = 9 * (0.05 + 0.002) + shared * 0.002  # its steps, slowed by the rows beside it
    others = shared * 0.002  # its row in each step they share
    assert added_latency(cost, 0, 20, 2, decoding, 10) == pytest.approx(ttft + own + others)
    assert added_latency(cost, 0, 20, 2, decoding, 1) == pytest.approx(ttft)  # one token out


def test_a_cached_prompt_wins_while_the_loads_are_close_and_loses_to_a_lighter_replica():
    """Replica 0 holds an 8-block system prompt (128 tokens: 0.128 s of prefill at 1 ms a
    token); each replica decodes rows with 8 tokens left. With as many rows on both, or one
    more on replica 0, the cache wins; with two more the request's 15 decode steps, slowed by
    them and slowing them, outweigh the prefill it saves, and replica 1 takes it."""
    cost = StepCost(step_s=0.03, prefill_token_s=0.001, decode_row_s=0.005, steps=100)
    costs, uncached = [cost, cost], [10, 138]

    def pick(rows: list[int]) -> int | None:
        decoding = [Decoding(tokens_left=(8,) * r) for r in rows]
        return choose_by_latency(
            uncached, [0, 0], rows, costs, BOTH, decoding=decoding, out_tokens=16
        )

    assert pick([4, 4]) == 0
    assert pick([5, 4]) == 0
    assert pick([6, 4]) == 1
    # priced by the first token alone it would stay with the cache however loaded
    assert choose_by_latency(uncached, [0, 0], [6, 4], costs, BOTH) == 0


def test_a_replica_counts_the_tokens_its_streams_have_left():
    """Two requests of max_tokens 8 routed to one replica: both rows count 8 left until tokens
    stream; each token streamed is one fewer; an ended request counts no more."""
    client = TokenClient()
    router = KvRouter([ReplicaIndex(1000, BS), ReplicaIndex(1000, BS)], BS, 64, assume_s=0.0)
    replicas = ReplicaSet([client, TokenClient()], BS, 4, 4, 60.0, policy="kv_events", kv=router)
    replicas.replicas[1].up = False  # both requests to replica 0
    replica = replicas.replicas[0]
    params = SamplingParams(max_tokens=8)

    async def run() -> list[Decoding]:
        seen = []
        streams = [replicas.generate(list(range(40)), params) for _ in range(2)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0.01)
        seen.append(replica.decoding(60.0))  # both routed, neither streamed yet
        client.step.set()
        await asyncio.gather(*firsts)
        seen.append(replica.decoding(60.0))  # one token each
        for stream in streams:
            await stream.aclose()
        seen.append(replica.decoding(60.0))
        return seen

    before, after_one, ended = asyncio.run(run())
    assert before == Decoding(tokens_left=(8, 8))
    assert after_one == Decoding(tokens_left=(7, 7))
    assert ended == Decoding()


class TokenClient:
    """Streams a token each time `step` is set, up to max_tokens."""

    def __init__(self):
        self.step = asyncio.Event()

    async def generate(self, prompt, params, request_id, priority, resume=None, tenant=None):
        for i in range(params.max_tokens):
            await self.step.wait()
            last = i == params.max_tokens - 1
            yield Delta(
                request_id, token_ids=[i], finish_reason=FinishReason.LENGTH if last else None
            )

    async def close(self):
        pass
