"""The Scheduler's planning: a pure object that takes messages and returns the ones to send.

A step: pick requests under `max_num_seqs` and `max_num_batched_tokens` (the new requests' share
is spent by the BlockManager, which knows their prefix-cache hits) -> one AllocateStep round trip
(the BlockManager reuses cached prefixes, and preempts from the tail when blocks run out)
-> StepPlan with only what changed -> StepResult -> stop checks -> TokensOut.
Running requests also ask for a block of room beyond the step (BlockNeed.lookahead, granted from
spare blocks only), and the planner counts the room each one holds (`Request.capacity`): a step
that admits nobody and whose tokens all fit skips the round trip, so steady decoding asks the
BlockManager about once every block_size steps instead of every step.

Overlap (async_scheduling): while the Worker runs step N, step N+1 is planned and allocated, so
the Worker goes from one step to the next without waiting for a round trip. Such a step assumes
each request that samples in step N gets one token (the Worker already has it: the persistent
batch appends what it samples) and leaves out those that step N ends by length. It is
allocated with `overlapped=True`: nobody is preempted or swapped, and forks wait, so a request
in flight never loses its blocks; if the running requests do not fit, the BlockManager refuses
the whole step and the planner plans again, the normal way, once step N is done. A request
that step N ends (stop token, abort) is computed once more by step N+1 and that token dropped.
Blocks freed meanwhile may go to others only from step N+2 on, which the Worker runs after step
N+1, so a step never sees its blocks rewritten. Likewise a request aborted while its step is
being allocated is computed by that step all the same (its tokens dropped): the BlockManager
has put the blocks the step fills in the prefix cache, and others may hit them.

The budget goes to every running decode first, then to running prefill chunks, then to waiting
requests in the fair order (admission.py: by priority; within a priority, the client holding
the fewest seats first, then by arrival). Since max_num_batched_tokens >= max_num_seqs (checked
at start), a running decode is never skipped: however long a prompt, it delays each decode by at
most one step whose size is bounded by the token budget, and with
`max_prefill_tokens_beside_decodes` by that many prompt tokens (step_budget.py). When no seat is
free, the next waiting request takes one, recomputing its holder: the lowest-priority running
request's if that is of lower priority; else, at its own priority, one of the client holding the
most seats when its own client holds at least two fewer (admission.fair_victim). So one client's
requests, running however long and read or not, keep a client holding no seat waiting a step or
two at most.
Preemption victims (the tail of AllocateStep.needs) are the lowest priority, then either the
fewest computed tokens (least work lost, the default) or the last admitted.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from ...messages.blocks import AllocateStep, Allocation, FreeBlocks, Grant
from ...messages.client import EngineStats
from ...messages.common import FinishReason
from ...messages.step import (
    AbortRequests,
    AddRequest,
    RunningUpdate,
    StepPlan,
    StepResult,
    TokensOut,
)
from ..runtime.config import EngineConfig
from .admission import WaitingQueue, fair_victim
from .request_state import Request
from .step_budget import split_budget
from .step_cost import StepCostFit


@dataclass(slots=True)
class PendingAllocation:
    """An AllocateStep awaiting its Allocation: the requests it asks for, each running one's
    told_block_manager before it (restored if the BlockManager denies it), and whether it was
    planned while a step ran."""

    step_id: int
    requests: dict[str, Request]
    told: dict[str, int]
    overlapped: bool


class StepPlanner:
    """Each method takes a message and returns what to send (None: nothing); `plan()` returns
    the next step's message, one a call, until None. Send `take_frees()` before each: the
    BlockManager frees finished and displaced requests' blocks before it allocates a step."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.eos_token_ids = config.facts.eos_token_ids
        self.arrivals = itertools.count()
        self.counters = EngineStats()  # the Scheduler's counters (the BlockManager adds its own)
        self.victim_order = Request.victim_order(config.preemption_victim)  # sort key, last first
        self.step_costs = StepCostFit(config.max_num_batched_tokens, config.max_num_seqs or 1)
        self.reset(config.epoch)

    def reset(self, epoch: int) -> None:
        """Forget every request (the Engine re-submits them); stamp messages with `epoch`."""
        self.epoch = epoch
        self.waiting = WaitingQueue(self.config)  # offered in the fair order (admission.py)
        self.running: dict[str, Request] = {}  # admitted, in the Worker's persistent batch
        self.requests: dict[str, Request] = {}
        self.removed: list[str] = []  # to drop from the Worker's batch with the next plan
        self.frees: list[str] = []  # requests whose blocks the BlockManager is to free
        self.step_id = 0
        self.pending: PendingAllocation | None = None
        self.overlap_paused = False  # an overlapped step came to nothing: wait for the Worker
        self.stalled = False  # nobody could be admitted, nothing runs: wait for an arrival
        # steps the Worker has or will run, oldest first: (step id, [(request, its tokens)])
        self.in_flight: deque[tuple[int, list[tuple[Request, int]]]] = deque()

    def take_frees(self) -> FreeBlocks | None:
        """The frees to send the BlockManager before anything else (None: none)."""
        frees, self.frees = self.frees, []
        return FreeBlocks(self.epoch, frees) if frees else None

    def is_stale(self, message: Allocation | StepResult) -> bool:
        """From before a reset, or for a step this planner does not wait for."""
        if message.epoch != self.epoch:
            return True
        if isinstance(message, Allocation):
            return self.pending is None or message.step_id != self.pending.step_id
        return not self.in_flight or message.step_id != self.in_flight[0][0]

    # -- requests in and out -----------------------------------------------------------------

    def add(self, message: AddRequest) -> None:
        if message.request_id in self.requests:
            return  # a re-sent request (the Engine's journal) that is already here
        max_len = self.config.max_model_len
        request = Request(message, self.eos_token_ids, next(self.arrivals), max_len)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.counters.prompt_tokens += request.num_prompt_tokens
        self.stalled = False

    def abort(self, message: AbortRequests) -> TokensOut | None:
        aborted = [self.requests[rid] for rid in message.request_ids if rid in self.requests]
        for request in aborted:
            self._finish(request)
        if not aborted:
            return None
        return TokensOut(self.epoch, [r.last_output(FinishReason.ABORT) for r in aborted])

    def _finish(self, request: Request) -> None:
        """Forget a request; its blocks go back to the pool (freed before any new step)."""
        rid = request.request_id
        del self.requests[rid]
        if self.running.pop(rid, None) is not None:
            self.removed.append(rid)
        else:
            self.waiting.remove(request)
        self.frees.append(rid)

    def _preempt(self, request: Request, swapped: bool) -> None:
        """Back to the queue (at its place by priority and arrival). Recompute unless swapped."""
        del self.running[request.request_id]
        request.swapped = swapped
        request.told_block_manager = 0  # the BlockManager forgot its tokens either way
        if not swapped:
            self.counters.num_recomputed_tokens += request.num_computed
            request.num_computed = 0
        request.num_scheduled = request.num_computed  # nothing is in flight when preempting
        request.capacity = 0  # its blocks are freed or swapped out
        self.removed.append(request.request_id)
        self.waiting.add(request)
        self.counters.num_preemptions += 1
        self.counters.num_swaps += swapped

    # -- planning a step ---------------------------------------------------------------------

    def plan(self) -> AllocateStep | StepPlan | None:
        """The next step, with no step in flight or (async_scheduling) while one runs: a StepPlan
        within the blocks its requests hold (call again: the next may be planned while it runs),
        an AllocateStep (then wait for `granted`), or None (nothing to plan now)."""
        if self.pending is not None or self.stalled or not (self.running or self.waiting):
            return None
        overlapped = bool(self.in_flight)
        if overlapped and not self._may_overlap():
            return None
        if not overlapped:
            self._make_seats()
        split = split_budget(self.running.values(), self.config)
        counts, budget = split.counts, split.new_tokens
        running = {rid: self.running[rid] for rid in counts}
        seats = self._seats_held() if self.waiting else {}
        admissions = self.waiting.offers(seats, self.running, self.requests, overlapped, budget)
        if running and not admissions and split.held:
            return self._plan_in_held_blocks(counts, overlapped)
        told = {rid: r.told_block_manager for rid, r in running.items()}
        needs = [
            r.block_need(counts[r.request_id], False, self.config.block_size)
            for r in sorted(running.values(), key=self.victim_order)
        ]
        for need, request in admissions:
            needs.append(need)
            running[request.request_id] = request
        if not needs:
            return None
        self.step_id += 1
        self.counters.num_block_round_trips += 1
        self.pending = PendingAllocation(self.step_id, running, told, overlapped)
        return AllocateStep(self.epoch, self.step_id, needs, budget, overlapped=overlapped)

    def _plan_in_held_blocks(self, counts: dict[str, int], overlapped: bool) -> StepPlan:
        """A step of running requests only, each within the blocks it holds: no AllocateStep."""
        self.step_id += 1
        plan = StepPlan(self.epoch, self.step_id, self.removed, [], [])
        self.removed = []
        scheduled = [(self.running[rid], count) for rid, count in counts.items()]
        for request, count in scheduled:
            request.schedule_tokens(request.num_scheduled, count)
            plan.running.append(RunningUpdate(request.request_id, [], count))
        return self._launch(plan, scheduled, overlapped)

    def _launch(self, plan: StepPlan, scheduled: list[tuple[Request, int]], overlapped: bool):
        """The Worker will run it: its StepResult is awaited in order."""
        self.in_flight.append((self.step_id, scheduled))
        self.counters.num_overlapped_steps += overlapped
        return plan

    def _may_overlap(self) -> bool:
        """Whether a step may be planned while the one in flight runs: not while two are, nor
        when what only a step planned with nothing in flight may do comes first (a seat taken,
        for a higher priority or a fair share, or a swap-in or a fork first in the fair order)."""
        if len(self.in_flight) > 1 or self.overlap_paused or not self.config.async_scheduling:
            return False
        if not self.waiting:
            return True
        if len(self.running) >= self.config.max_num_seqs:
            return self._seat_to_take() is None
        head = self._next_waiting(self._seats_held())
        return head is None or not (head.swapped or head.fork_of is not None)

    def _make_seats(self) -> None:
        """With every seat taken, the next waiting request takes the seat `_seat_to_take` names."""
        while self.waiting and len(self.running) >= self.config.max_num_seqs:
            victim = self._seat_to_take()
            if victim is None:
                return
            self.frees.append(victim.request_id)
            self._preempt(victim, swapped=False)

    def _seat_to_take(self) -> Request | None:
        """The running request whose seat the next waiting one takes (None: it waits for one):
        the lowest-priority one if of lower priority, else its client's fair share's."""
        seats = self._seats_held()
        head = self._next_waiting(seats)
        if head is None:
            return None
        worst = max(self.running.values(), key=lambda r: r.queue_key)
        if head.priority < worst.priority:
            return worst
        return fair_victim(head, self.running.values(), seats, self.victim_order)

    def _next_waiting(self, seats: dict[str, int]) -> Request | None:
        """The waiting request the next step offers first (a fork waiting for its sample 0 is
        passed over), None when none may be offered."""
        return next(self.waiting.fair_order(seats, self.running, self.requests), None)

    def _seats_held(self) -> dict[str, int]:
        """Each client's running requests."""
        seats: dict[str, int] = {}
        for request in self.running.values():
            seats[request.client] = seats.get(request.client, 0) + 1
        return seats

    # -- the BlockManager's answer -----------------------------------------------------------

    def granted(self, message: Allocation) -> StepPlan | None:
        """The StepPlan of the allocated step (None: nothing to tell the Worker). A plan with
        nobody to compute (all preempted, denied or refused) only drops requests or swaps out."""
        if self.is_stale(message):
            return None
        pending, self.pending = self.pending, None
        # Denied: the BlockManager did not take this need's tokens. A new request starts over;
        # a running one (an overlapped step the BlockManager refused whole) is as before it.
        for rid in message.denied:
            if rid in self.requests:
                self.requests[rid].told_block_manager = pending.told.get(rid, 0)
        for rids, swapped in ((message.preempted, False), (message.swapped, True)):
            for rid in rids:
                if rid in self.requests:  # else aborted while the allocation was on its way
                    self._preempt(self.requests[rid], swapped)
        # A grant to a request aborted meanwhile is computed all the same (see the module's
        # docstring); it leaves the Worker's batch with the next plan.
        gone = [g.request_id for g in message.granted if not self._alive(pending, g.request_id)]
        removed = [rid for rid in self.removed if rid not in gone]
        swaps = (message.swap_out, message.swap_in, message.copies)
        plan = StepPlan(self.epoch, pending.step_id, removed, [], [], *swaps)
        self.removed = gone
        scheduled = []
        for grant in message.granted:
            request = pending.requests[grant.request_id]
            self._schedule_grant(request, grant, plan, pending)
            scheduled.append((request, grant.num_new_tokens))
        if scheduled:
            return self._launch(plan, scheduled, pending.overlapped)
        if pending.overlapped:  # wait for the step in flight (unless it is done)
            self.overlap_paused = True
        elif not (message.preempted or message.swapped):  # the pool is as it was
            self.stalled = True
        if plan.removed or plan.swap_out:
            plan.swap_in = []
            return plan
        return None

    def _alive(self, pending: PendingAllocation, request_id: str) -> bool:
        return self.requests.get(request_id) is pending.requests[request_id]

    def _schedule_grant(
        self, request: Request, grant: Grant, plan: StepPlan, pending: PendingAllocation
    ) -> None:
        request.schedule_tokens(grant.num_computed, grant.num_new_tokens)
        room = len(grant.block_ids) * self.config.block_size
        rid = request.request_id
        if rid in pending.told:  # it was running: block_ids are its new blocks
            request.capacity += room
            plan.running.append(RunningUpdate(rid, grant.block_ids, grant.num_new_tokens))
            return
        if self._alive(pending, rid):
            self.waiting.remove(request)
            self.running[rid] = request
        plan.new.append(request.admit(grant, room))  # block_ids: its whole table

    # -- the Worker's answer -----------------------------------------------------------------

    def applied(self, message: StepResult, flush_held: bool = False) -> TokensOut | None:
        """Append the step's tokens, finish whom they end; the TokensOut for the Engine. A
        failed step fails its requests. `flush_held`: add what final_only requests hold."""
        if self.is_stale(message):
            return None
        _, scheduled = self.in_flight.popleft()
        self.overlap_paused = False
        self.stalled = False
        self.counters.num_steps += 1
        if message.error is not None:
            failed = [r for r, _ in scheduled if self.requests.get(r.request_id) is r]
            outputs = [r.last_output(FinishReason.ERROR) for r in failed]
            for request in failed:
                self._finish(request)
        else:
            self.step_costs.observe_step((count for _, count in scheduled), message.forward_s)
            outputs = self._apply(scheduled, message)
        if flush_held:
            outputs.extend(r.take_output() for r in self.requests.values() if r.unsent is not None)
        return TokensOut(self.epoch, outputs) if outputs else None

    def _apply(self, scheduled: list[tuple[Request, int]], result: StepResult):
        live = {}  # the step's requests not finished or aborted since it was planned
        for request, count in scheduled:
            if self.requests.get(request.request_id) is request:
                live[request.request_id] = request
                request.num_computed += count
                if request.num_computed < len(request.token_ids):
                    self.counters.num_partial_prefills += 1
        for chunk in result.prompt_logprobs:
            request = live.get(chunk.request_id)
            if request is not None:
                request.add_prompt_logprobs(chunk)
        outputs, generated = [], 0
        logprobs = result.logprobs or itertools.repeat(None)
        for rid, token, lp in zip(result.request_ids, result.token_ids, logprobs):
            request = live.get(rid)
            if request is None:  # finished or aborted since the step was planned
                continue
            generated += 1
            output = request.add_sample(token, lp)
            if output is None:
                continue  # held (final_only)
            if output.finish_reason is not None:
                self._finish(request)
            outputs.append(output)
        self.counters.generation_tokens += generated
        return outputs
