"""The step planner in-process: a real BlockPool as the BlockManager, a fake Worker over a
simulated KV cache, a scripted Engine, and a driver that delivers their messages in a random
order (each mailbox in order, as ZeroMQ keeps it), checking the documented rules as it goes.
The fair order and the seat rules are written again from the planner's docstrings
(tests/fair_share_rules.py), not taken from its code.

The fake Worker (tests/fake_worker.py) checks that every step reads only KV written for its own
tokens.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

from fair_share_rules import Waiting, fair_order, head, seat_taker
from fake_worker import EOS, VOCAB, FakeWorker

from actorserve.actors.block_manager.block_pool import BlockPool
from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_device
from actorserve.actors.runtime.model_config import ModelFacts
from actorserve.actors.scheduler.step_planner import StepPlanner
from actorserve.messages.blocks import AllocateStep, Allocation, FreeBlocks
from actorserve.messages.common import FinishReason, OutputKind, SamplingParams
from actorserve.messages.step import AbortRequests, AddRequest, StepPlan, StepResult, TokensOut

PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [9, 9, 9, 9, 9, 9], [])  # shared prompt starts


def planner_config(**fields) -> EngineConfig:
    """A config as the supervisor hands it to the Scheduler: resolved for a CPU Worker."""
    fields.setdefault("max_model_len", 48)
    facts = ModelFacts(VOCAB, fields["max_model_len"], [EOS])
    return resolve_device(EngineConfig(model="in-process", facts=facts, **fields), "cpu")


@dataclass
class Spec:
    """One client request of a scripted workload."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    abort_after: int | None = None  # events after its arrival at which the client aborts it
    client: str = ""

    def adds(self) -> list[AddRequest]:
        """The Engine's AddRequests for it: n > 1 fans out into samples forking sample 0."""
        if self.params.n == 1:
            return [
                AddRequest(
                    self.request_id, self.prompt, self.params, [], self.priority, None, self.client
                )
            ]
        first = f"{self.request_id}#0"
        return [
            AddRequest(
                f"{self.request_id}#{i}",
                self.prompt,
                self.params,
                [],
                self.priority,
                first if i else None,
                self.client,
            )  # fmt: skip
            for i in range(self.params.n)
        ]


@dataclass
class Received:
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None


class Simulation:
    """One scripted workload through the planner, the pool and the fake Worker."""

    def __init__(self, config: EngineConfig, specs: list[Spec], seed: int, eos_rate: float = 0.1):
        self.config = config
        self.rng = random.Random(seed)
        self.planner = StepPlanner(config)
        self.pool = BlockPool.for_config(config)
        self.worker = FakeWorker(config, random.Random(seed + 1), eos_rate)
        self.specs = {s.request_id: s for s in specs}
        self.arrivals = deque(specs)
        self.aborts: list[tuple[int, str]] = []  # (event number, client request id)
        self.to_block_manager: deque[AllocateStep | FreeBlocks] = deque()
        self.to_worker: deque[StepPlan] = deque()
        self.allocations: deque[Allocation] = deque()
        self.results: deque[StepResult] = deque()
        self.received: dict[str, Received] = {}
        self.params: dict[str, tuple[SamplingParams, int]] = {}  # request id -> params, prompt
        self.aborted: set[str] = set()
        self.arrival_of: dict[str, int] = {}
        self.events = 0
        self.steps = 0
        self.planned: dict[int, dict] = {}  # AllocateStep id -> what plan() saw before it
        self.reused_while_queued = 0  # blocks granted while a step that used them had not run
        self.fair_displacements = 0  # seats taken for a client's fair share

    # -- sending, as the Scheduler actor does ----------------------------------------------

    def send(self, message) -> None:
        frees = self.planner.take_frees()
        if frees is not None:
            self.to_block_manager.append(frees)
        if message is None:
            return
        if isinstance(message, (AllocateStep, FreeBlocks)):
            self.to_block_manager.append(message)
        elif isinstance(message, StepPlan):
            self.worker.queued(message)
            self.to_worker.append(message)
        elif isinstance(message, TokensOut):
            self.take_tokens(message)

    def plan(self) -> None:
        while True:
            before = self.snapshot()
            message = self.planner.plan()
            self.check_seats(before)
            if message is None:
                return self.send(None)
            if isinstance(message, AllocateStep):  # what its offers were drawn from: the queue
                offered_from = self.snapshot()  # after any seat was taken
                self.planned[message.step_id] = {**before, "offered_from": offered_from}
            else:
                self.check_step(message, before, None)
            self.send(message)

    def snapshot(self) -> dict:
        planner = self.planner
        decodes = {
            rid
            for rid, r in planner.running.items()
            if r.num_unscheduled == 1 and not r.ends_in_flight()
        }
        waiting = [
            Waiting(
                r.request_id,
                r.priority,
                self.arrival_of[r.request_id],
                r.client,
                self.fork_waits(r),
            )
            for r in planner.waiting
        ]
        victim = {rid: self.victim_key(r) for rid, r in planner.running.items()}
        running = {rid: r.queue_key for rid, r in planner.running.items()}
        clients = {rid: r.client for rid, r in planner.running.items()}
        seats = Counter(clients.values())
        quiet = not planner.in_flight and planner.pending is None
        return {"decodes": decodes, "waiting": waiting, "victim": victim, "running": running,
                "clients": clients, "seats": seats, "quiet": quiet}  # fmt: skip

    def fork_waits(self, request) -> bool:
        """A fork whose sample 0 runs but has not computed the prompt yet may be passed over."""
        parent = self.planner.running.get(request.fork_of)
        if request.fork_of is None or request.fork_of not in self.planner.requests:
            return False
        return parent is None or parent.num_computed < request.num_prompt_tokens

    def victim_key(self, request) -> tuple:
        """The docstring's preemption order, written from the docstring: lowest priority (the
        largest number) first, then the fewest computed tokens or the last admitted."""
        if self.config.preemption_victim == "fewest_computed":
            return (request.priority, -request.num_computed, self.arrival_of[request.request_id])
        return (request.priority, self.arrival_of[request.request_id])

    # -- the rules checked at each step ----------------------------------------------------

    def check_step(self, plan: StepPlan, before: dict, allocation: Allocation | None) -> None:
        """Every running decode is in the step unless it lost its seat or its blocks, or ended;
        the step computes at most max_num_batched_tokens tokens, and beside decodes at most
        max_prefill_tokens_beside_decodes prompt tokens; the requests admitted are the first of
        the fair order (nobody jumps the queue, and no client holding fewer seats waits behind
        another's request); preemption victims come last in the documented order."""
        planner = self.planner
        in_step = {u.request_id for u in plan.running} | {n.request_id for n in plan.new}
        for rid in before["decodes"]:
            assert rid in in_step or rid not in planner.running, f"decode {rid} skipped"
        rows = [(u.request_id, u.num_new_tokens) for u in plan.running]
        rows += [(n.request_id, n.num_new_tokens) for n in plan.new]
        tokens = sum(count for _, count in rows)
        assert tokens <= self.config.max_num_batched_tokens, f"{tokens} tokens in one step"
        cap = self.config.max_prefill_tokens_beside_decodes
        if cap is not None and any(rid in before["decodes"] for rid, _ in rows):
            prompt = sum(count for rid, count in rows if rid not in before["decodes"])
            assert prompt <= cap, f"{prompt} prompt tokens beside decodes, over {cap}"
        if plan.new:
            offered_from = before["offered_from"]
            order = fair_order(offered_from["waiting"], offered_from["seats"])
            admitted = [n.request_id for n in plan.new]
            assert admitted == order[: len(admitted)], f"admitted {admitted}, fair order {order}"
        if allocation is not None:
            lost = set(allocation.preempted) | set(allocation.swapped)
            kept = [before["victim"][g.request_id] for g in allocation.granted
                    if g.request_id in before["victim"]]  # fmt: skip
            for rid in lost:
                assert all(k < before["victim"][rid] for k in kept), f"{rid} preempted too early"

    def check_seats(self, before: dict) -> None:
        """A running request loses its seat only to the next waiting one (the fair order's
        first): the lowest-priority, last-arrived one to one of higher priority; else, at that
        one's priority, the last by victim order of the client holding the most seats, when
        the waiting one's client holds at least two fewer. After a quiet plan, no such seat is
        left to take."""
        planner, seqs = self.planner, self.config.max_num_seqs
        displaced = [rid for rid in before["running"] if rid not in planner.running]
        for rid in displaced:
            assert seat_taker(before, seqs) == rid, f"{rid} displaced for nothing"
            self.fair_displacements += before["running"][rid][0] <= head(before).priority
        if before["quiet"] and planner.waiting and planner.pending is not None:
            if len(planner.running) >= self.config.max_num_seqs:
                assert seat_taker(self.snapshot(), seqs) is None, "a seat is left to take"

    def check_state(self) -> None:
        planner, pool = self.planner, self.pool
        owned = {b for table in pool.tables.values() for b in table}
        assert pool.num_free + len(owned) == pool.num_blocks, "a block leaked"
        for block in pool.blocks:
            held = sum(table.count(block.block_id) for table in pool.tables.values())
            assert block.ref_count == held, f"block {block.block_id} ref_count {block.ref_count}"
        assert len(planner.running) <= self.config.max_num_seqs
        waiting = {r.request_id for r in planner.waiting}
        assert set(planner.requests) == set(planner.running) | waiting
        assert not waiting & set(planner.running)
        allocating = planner.pending is not None
        for rid, request in planner.requests.items():
            request.check_invariants(rid in planner.running, allocating)
        if self.to_block_manager or self.allocations or allocating:
            return  # the BlockManager's view and the planner's differ by messages in transit
        assert set(pool.tables) == set(planner.running), "pool and planner disagree on who runs"
        bs = self.config.block_size
        for rid, request in planner.running.items():
            assert request.capacity == len(pool.tables[rid]) * bs, f"{rid}: capacity"
            assert request.told_block_manager == len(pool.tokens[rid]), f"{rid}: told"
        for request in planner.waiting:
            assert request.swapped == (request.request_id in pool.swapped), "swapped"

    # -- the other actors ------------------------------------------------------------------

    def block_manager_takes(self) -> None:
        message = self.to_block_manager.popleft()
        if isinstance(message, FreeBlocks):
            for rid in message.request_ids:
                self.pool.free(rid)
            return
        used = set().union(*self.worker.blocks_of_step.values())  # by steps not run yet
        free_before = set(self.pool._free)
        allocation = self.pool.allocate_step(
            message.needs, message.new_token_budget, message.overlapped, message.epoch,
            message.step_id,
        )  # fmt: skip
        for grant in allocation.granted:  # blocks handed out afresh while a step using them waits
            self.reused_while_queued += sum(
                1 for b in grant.block_ids if b in free_before and b in used
            )
        self.allocations.append(allocation)

    def worker_runs(self) -> None:
        self.steps += 1
        self.results.append(self.worker.run(self.to_worker.popleft()))

    def engine_adds(self) -> None:
        spec = self.arrivals.popleft()
        for add in spec.adds():
            self.arrival_of[add.request_id] = len(self.arrival_of)
            self.params[add.request_id] = (add.params, len(add.prompt_token_ids))
            self.received[add.request_id] = Received()
            self.planner.add(add)
        if spec.abort_after is not None:
            self.aborts.append((self.events + spec.abort_after, spec.request_id))
        while self.arrivals and self.rng.random() < 0.5:  # submitted together: one plan
            return self.engine_adds()
        self.plan()

    def engine_aborts(self, client_id: str) -> None:
        spec = self.specs[client_id]
        ids = [a.request_id for a in spec.adds()]
        live = [rid for rid in ids if self.received[rid].finish is None]
        self.aborted.update(live)
        self.send(self.planner.abort(AbortRequests(live)))

    def take_tokens(self, message: TokensOut) -> None:
        for output in message.outputs:
            received = self.received[output.request_id]
            assert received.finish is None, f"{output.request_id}: tokens after its finish"
            received.tokens += output.token_ids
            received.finish = output.finish_reason

    # -- the driver ------------------------------------------------------------------------

    def run(self, max_events: int = 200_000) -> None:
        actions = {
            "block_manager": (self.to_block_manager, self.block_manager_takes),
            "worker": (self.to_worker, self.worker_runs),
            "allocation": (self.allocations, self.scheduler_takes_allocation),
            "result": (self.results, self.scheduler_takes_result),
            "arrival": (self.arrivals, self.engine_adds),
        }
        while self.events < max_events:
            self.events += 1
            due = [a for a in self.aborts if a[0] <= self.events]
            if due:
                self.aborts.remove(due[0])
                self.engine_aborts(due[0][1])
            ready = [name for name, (queue, _) in actions.items() if queue]
            if not ready:
                if self.aborts:
                    continue
                break
            name = self.rng.choice(ready)
            actions[name][1]()
            self.check_state()
        assert not self.planner.requests, f"stalled with {list(self.planner.requests)} left"

    def scheduler_takes_allocation(self) -> None:
        message = self.allocations.popleft()
        before = self.planned.pop(message.step_id)
        plan = self.planner.granted(message)
        if plan is not None and (plan.running or plan.new):
            self.check_step(plan, before, message)
        self.send(plan)
        self.plan()

    def scheduler_takes_result(self) -> None:
        tokens = self.planner.applied(self.results.popleft(), self.rng.random() < 0.05)
        self.plan()
        self.send(tokens)

    # -- the end ---------------------------------------------------------------------------

    def check_outputs(self) -> None:
        """Every request ends once: aborted only if asked, else at its first stop token after
        min_tokens or at its length limit, with the tokens the Worker sampled for it."""
        assert self.pool.num_free == self.pool.num_blocks, "blocks not all back"
        assert self.pool.num_cpu_free == self.pool.num_cpu_blocks
        for rid, received in self.received.items():
            params, prompt = self.params[rid]
            out = received.tokens
            assert received.finish is not None, f"{rid} never finished"
            assert out == self.worker.sampled.get(rid, [])[: len(out)], f"{rid}: not its tokens"
            stops = params.stop_token_set([EOS])
            first_stop = next(
                (i + 1 for i, t in enumerate(out) if t in stops and i + 1 >= params.min_tokens),
                None,
            )
            limit = min(params.max_tokens, self.config.max_model_len - prompt)
            if received.finish is FinishReason.ABORT:
                assert rid in self.aborted, f"{rid} aborted unasked"
                assert first_stop is None and len(out) < limit
            elif received.finish is FinishReason.STOP:
                assert first_stop == len(out), f"{rid}: stop at {len(out)}, first {first_stop}"
            else:
                assert received.finish is FinishReason.LENGTH, received.finish
                assert first_stop is None and len(out) == limit, f"{rid}: {len(out)} of {limit}"


def final_only(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**_fields(params), "output_kind": OutputKind.FINAL_ONLY})


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}
