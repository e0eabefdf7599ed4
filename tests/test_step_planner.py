"""The Scheduler's step planner in-process, against a real BlockPool and a fake Worker.

Random workloads (hypothesis) run to their end with every rule checked after every message
(tests/step_planner_support.py): the token budget and max_num_seqs hold in every step; every
running decode is in every step it can be; the pool leaks and double-counts no block; a step
reads only KV written for its own tokens (so overlapped steps never see their blocks
rewritten); preemption takes the documented victims, seats go to higher priorities and to
clients holding fewer, nobody jumps the queue and clients take turns (the fair order); every
request ends once, at its stop token or its length, with the tokens the Worker sampled for it.
Each test below draws workloads that stress one of these rules.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from step_planner_support import PREFIXES, Simulation, Spec, final_only, planner_config

from actorserve.actors.block_manager.block_pool import BlockPool
from actorserve.actors.scheduler.step_planner import StepPlanner
from actorserve.messages.blocks import AllocateStep
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import AbortRequests, AddRequest, StepPlan, StepResult

MAX_MODEL_LEN = 48
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs(draw, count=(1, 10), priorities=(0, 0), forks=False, aborts=False, clients=2):
    """Requests of up to `clients` clients (the first, "hog", sending more than the others)."""
    out = []
    for i in range(draw(st.integers(*count))):
        prefix = PREFIXES[draw(st.integers(0, len(PREFIXES) - 1))]
        tail = draw(st.lists(st.integers(2, 11), min_size=1, max_size=36 - len(prefix)))
        max_tokens = draw(st.integers(1, 20))
        params = SamplingParams(
            n=draw(st.integers(2, 3)) if forks and draw(st.booleans()) else 1,
            max_tokens=max_tokens,
            min_tokens=draw(st.sampled_from([0, 0, min(3, max_tokens)])),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.sampled_from([[], [3]])),
        )
        if draw(st.integers(0, 4)) == 0:
            params = final_only(params)
        abort_after = draw(st.one_of(st.none(), st.integers(1, 300))) if aborts else None
        priority = draw(st.integers(*priorities))
        client = draw(st.sampled_from(["hog"] * clients + [f"c{k}" for k in range(1, clients)]))
        out.append(Spec(f"r{i}", prefix + tail, params, priority, abort_after, client))
    return out


@st.composite
def configs(draw, blocks=(1, 3), spare=(0, 12), async_scheduling=None, seqs=(1, 6)):
    """A pool of `blocks` times max_model_len plus `spare` blocks; async_scheduling None: either."""
    block_size = draw(st.sampled_from([4, 8]))
    min_blocks = -(-MAX_MODEL_LEN // block_size)
    num_blocks = min_blocks * draw(st.integers(*blocks)) + draw(st.integers(*spare))
    max_num_seqs = draw(st.integers(*seqs))
    swap = draw(st.booleans())
    return planner_config(
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 40)),
        preemption_mode="swap" if swap else "recompute",
        num_cpu_blocks=draw(st.integers(0, num_blocks)) if swap else 0,
        preemption_victim=draw(st.sampled_from(["fewest_computed", "last_admitted"])),
        async_scheduling=draw(st.booleans()) if async_scheduling is None else async_scheduling,
        enable_prefix_caching=draw(st.booleans()),
        max_prefill_tokens_beside_decodes=draw(st.one_of(st.none(), st.integers(1, 12))),
    )


def simulate(config, workload, seed) -> Simulation:
    simulation = Simulation(config, workload, seed)
    simulation.run()
    simulation.check_outputs()
    return simulation


@settings(max_examples=100, **SETTINGS)
@given(configs(), specs(count=(1, 12)), st.integers(0, 2**32))
def test_budgets_hold_and_every_running_decode_is_in_every_step_it_can_be(config, work, seed):
    simulate(config, work, seed)


@settings(max_examples=100, **SETTINGS)
@given(
    configs(blocks=(1, 1), spare=(0, 2), seqs=(2, 6)),
    specs(count=(4, 14)),
    st.integers(0, 2**32),
)
def test_small_pools_preempt_in_the_documented_order_and_leak_no_block(config, work, seed):
    simulate(config, work, seed)


@settings(max_examples=100, **SETTINGS)
@given(
    configs(blocks=(1, 2), async_scheduling=True),
    specs(count=(2, 12), forks=True, aborts=True),
    st.integers(0, 2**32),
)
def test_overlapped_steps_read_only_their_own_kv_through_forks_aborts_and_stops(config, work, seed):
    simulate(config, work, seed)


@settings(max_examples=100, **SETTINGS)
@given(
    configs(seqs=(1, 3)),
    specs(count=(3, 12), priorities=(0, 2)),
    st.integers(0, 2**32),
)
def test_higher_priorities_take_seats_and_nobody_jumps_the_queue(config, work, seed):
    simulate(config, work, seed)


@settings(max_examples=40, **SETTINGS)
@given(
    configs(),
    specs(count=(1, 12), priorities=(0, 1), forks=True, aborts=True),
    st.integers(0, 2**32),
)
def test_every_request_ends_once_at_its_stop_token_or_length_or_when_aborted(config, work, seed):
    simulate(config, work, seed)


@settings(max_examples=100, **SETTINGS)
@given(
    configs(seqs=(1, 4)),
    specs(count=(4, 14), priorities=(0, 1), clients=4),
    st.integers(0, 2**32),
)
def test_clients_take_turns_and_one_holding_fewer_seats_never_waits_behind_another(
    config, work, seed
):
    """With k clients waiting at one priority, every step admits from the fair order's head:
    no client holding fewer seats waits behind another client's request, however much earlier
    the other's came; and seats move to a client holding two fewer than the one holding most."""
    simulate(config, work, seed)


def test_the_random_workloads_reach_the_hard_cases():
    """Preemption (both modes), forks, overlapped steps, held-block steps, blocks reused while a
    step that used them waits, and seats taken for a client's fair share all happen, so the
    rules above are really exercised."""
    kinds = ["preemptions", "swaps", "forks", "overlapped", "held", "reused", "fair_seats"]
    totals = dict.fromkeys(kinds, 0)
    for seed in range(12):
        swap = seed % 2 == 0
        config = planner_config(
            block_size=4,
            num_kv_blocks=14,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            preemption_mode="swap" if swap else "recompute",
            num_cpu_blocks=14 if swap else 0,
        )
        params = SamplingParams(n=1 + seed % 3, max_tokens=16, ignore_eos=seed % 4 == 1)
        prompts = [PREFIXES[i % 3] + [2 + i] * (5 + i) for i in range(6)]
        work = [
            Spec(f"r{i}", p, params, abort_after=40 * i or None, client="hog" if i < 4 else "b")
            for i, p in enumerate(prompts)
        ]
        simulation = simulate(config, work, seed)
        stats = simulation.planner.counters
        totals["preemptions"] += stats.num_preemptions - stats.num_swaps
        totals["swaps"] += stats.num_swaps
        totals["forks"] += simulation.pool.num_forks
        totals["overlapped"] += stats.num_overlapped_steps
        totals["held"] += stats.num_steps - stats.num_block_round_trips
        totals["reused"] += simulation.reused_while_queued
        totals["fair_seats"] += simulation.fair_displacements
    assert all(totals.values()), totals


# -- the planner's messages, one at a time --------------------------------------------------


def one_request_planner(**fields):
    config = planner_config(block_size=8, num_kv_blocks=16, **fields)
    planner = StepPlanner(config)
    planner.add(AddRequest("a", [5] * 16, SamplingParams(max_tokens=20, ignore_eos=True)))
    return planner, BlockPool.for_config(config)


def allocate(pool: BlockPool, message: AllocateStep):
    """What the BlockManager answers."""
    return pool.allocate_step(
        message.needs, message.new_token_budget, message.overlapped, message.epoch, message.step_id
    )


def run_step(planner, pool, plan) -> None:
    """The Worker samples token 7 for whoever reaches its last token."""
    sampling = [u.request_id for u in plan.running] + [n.request_id for n in plan.new]
    result = StepResult(plan.epoch, plan.step_id, sampling, [7] * len(sampling))
    planner.applied(result)


def test_a_step_is_an_allocate_step_then_the_granted_plan_then_the_applied_tokens():
    planner, pool = one_request_planner(async_scheduling=False)
    step = planner.plan()
    assert isinstance(step, AllocateStep) and planner.plan() is None  # one at a time
    plan = planner.granted(allocate(pool, step))
    assert isinstance(plan, StepPlan) and [n.request_id for n in plan.new] == ["a"]
    tokens = planner.applied(StepResult(0, plan.step_id, ["a"], [7]))
    assert tokens.outputs[0].token_ids == [7] and planner.requests["a"].num_computed == 16


def test_decoding_within_held_blocks_asks_the_block_manager_nothing():
    planner, pool = one_request_planner(async_scheduling=False)
    step = planner.plan()
    run_step(planner, pool, planner.granted(allocate(pool, step)))
    # the first decode needs a third block and asks for room beyond it (lookahead): the next
    # decodes fit in what it holds
    step = planner.plan()
    run_step(planner, pool, planner.granted(allocate(pool, step)))
    assert isinstance(planner.plan(), StepPlan)


def test_with_async_scheduling_the_next_step_is_planned_while_one_runs_but_not_two():
    planner, pool = one_request_planner(async_scheduling=True)
    step = planner.plan()
    plan = planner.granted(allocate(pool, step))
    overlapped = planner.plan()
    assert isinstance(overlapped, AllocateStep) and overlapped.overlapped
    second = planner.granted(allocate(pool, overlapped))
    assert second.running[0].num_new_tokens == 1  # the token step 1 samples, not yet known
    assert planner.plan() is None  # two steps in flight: wait for the Worker
    run_step(planner, pool, plan)
    assert planner.requests["a"].samples_in_flight == 1


def test_an_abort_frees_blocks_before_the_next_allocate_step():
    planner, pool = one_request_planner(async_scheduling=False)
    step = planner.plan()
    planner.granted(allocate(pool, step))
    tokens = planner.abort(AbortRequests(["a"]))
    assert tokens.outputs[0].finish_reason == "abort"
    assert planner.take_frees().request_ids == ["a"] and planner.take_frees() is None


def test_request_invariants_name_the_broken_relation():
    planner, pool = one_request_planner(async_scheduling=False)
    request = planner.requests["a"]
    request.check_invariants(running=False)
    request.num_scheduled = 3
    with pytest.raises(AssertionError, match="waiting: nothing in flight"):
        request.check_invariants(running=False)


def test_a_request_aborted_while_its_step_is_allocated_is_still_computed_by_that_step():
    """The BlockManager put the blocks that step fills in the prefix cache: were they not
    computed, a request with the same prompt would read KV that was never written."""
    config = planner_config(block_size=4, num_kv_blocks=16, max_num_seqs=1, async_scheduling=False)
    planner, pool = StepPlanner(config), BlockPool.for_config(config)
    for rid in ("a", "b"):
        planner.add(AddRequest(rid, list(range(2, 11)), SamplingParams(max_tokens=4)))
    step = planner.plan()
    assert planner.abort(AbortRequests(["a"])).outputs[0].finish_reason == "abort"
    plan = planner.granted(allocate(pool, step))
    pool.free(planner.take_frees().request_ids[0])  # the free follows the AllocateStep
    assert [n.request_id for n in plan.new] == ["a"]  # computed, its token dropped
    run_step(planner, pool, plan)
    step = planner.plan()
    plan = planner.granted(allocate(pool, step))
    assert plan.removed == ["a"] and plan.new[0].request_id == "b"
    assert plan.new[0].num_computed_tokens == 8  # a's two full blocks, hit


def test_after_a_reset_the_planner_forgets_every_request_and_drops_the_old_epochs_answers():
    planner, pool = one_request_planner(async_scheduling=False)
    allocation = allocate(pool, planner.plan())
    planner.reset(1)
    assert planner.is_stale(allocation) and planner.granted(allocation) is None
    assert not planner.requests and planner.plan() is None and planner.take_frees() is None


def one_step(planner: StepPlanner, pool: BlockPool) -> StepPlan | None:
    """Plan a step, have the pool allocate it (frees first, as the Scheduler sends them) and
    the Worker run it; the plan, if it computed anything."""

    def free() -> None:
        frees = planner.take_frees()
        for rid in frees.request_ids if frees else ():
            pool.free(rid)

    message = planner.plan()
    free()
    if isinstance(message, AllocateStep):
        message = planner.granted(allocate(pool, message))
        free()
    if message is None or not (message.running or message.new):
        return None
    run_step(planner, pool, message)
    free()
    return message


def hogged_planner(hog_priority: int = 0):
    """Four seats, all held by the hog's long requests, and four more of its own waiting."""
    config = planner_config(
        block_size=8, num_kv_blocks=64, max_num_seqs=4, max_model_len=128, async_scheduling=False
    )
    planner, pool = StepPlanner(config), BlockPool.for_config(config)
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    for i in range(8):
        planner.add(AddRequest(f"hog{i}", [5] * 9, long, [], hog_priority, None, "hog"))
    one_step(planner, pool)
    assert sorted(planner.running) == [f"hog{i}" for i in range(4)]
    return planner, pool


def test_a_client_holding_no_seat_takes_one_from_the_client_holding_every_seat_at_once():
    planner, pool = hogged_planner()
    short = SamplingParams(max_tokens=3)
    planner.add(AddRequest("b", [6] * 5, short, [], 0, None, "b"))
    plan = one_step(planner, pool)  # the hog's least advanced request gives its seat up
    assert [n.request_id for n in plan.new] == ["b"] and "hog3" in plan.removed
    steps = 1
    while "b" in planner.requests:
        one_step(planner, pool)
        steps += 1
    assert steps == 3  # b's three tokens, one a step, from its first step on
    one_step(planner, pool)  # the seat goes back to the hog: its earliest waiting request
    assert sorted(planner.running) == ["hog0", "hog1", "hog2", "hog3"]
    assert planner.counters.num_preemptions == 1


def test_two_clients_waiting_are_admitted_in_turn_before_the_hogs_backlog():
    planner, pool = hogged_planner()
    params = SamplingParams(max_tokens=50)
    for name in ("b", "c"):
        for i in range(2):
            planner.add(AddRequest(f"{name}{i}", [6] * 5, params, [], 0, None, name))
    admitted = []
    for _ in range(4):
        plan = one_step(planner, pool)
        admitted += [n.request_id for n in plan.new] if plan else []
    # b and c take a seat each from the hog (holding 4, then 3); then the hog holds 2, as
    # many as b and c hold with their second requests: nobody takes a seat from anybody
    assert admitted == ["b0", "c0"]
    assert sorted(r.client for r in planner.running.values()) == ["b", "c", "hog", "hog"]


def test_a_lower_priority_client_takes_no_seat_from_a_higher_priority_one():
    planner, pool = hogged_planner(hog_priority=0)
    planner.add(AddRequest("b", [6] * 5, SamplingParams(max_tokens=3), [], 1, None, "b"))
    for _ in range(5):
        one_step(planner, pool)
    assert "b" not in planner.running and planner.counters.num_preemptions == 0
