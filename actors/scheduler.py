"""Scheduler actor: continuous batching, with up to two steps in flight.

Inbox: AddRequest, AbortRequests, StatsQuery (Engine); Allocation (BlockManager); StepResult
(Worker); Reset (supervisor, after a restart); Stop.
Outbox: AllocateStep, FreeBlocks, StatsQuery, Reset -> BlockManager; StepPlan, Reset -> the
Worker's forward thread (its mailbox WORKER_STEPS); TokensOut, Recover -> Engine.
Owns: the waiting queue and running set, every request's tokens and computed-token count.
Dies when: Stop, or its supervisor goes away (then by SIGTERM).

A step: pick requests under `max_num_seqs` and `max_num_batched_tokens` (the new requests' share
is spent by the BlockManager, which knows their prefix-cache hits) -> one AllocateStep round trip
(the BlockManager reuses cached prefixes, and preempts from the tail when blocks run out)
-> StepPlan with only what changed -> StepResult -> stop checks -> TokensOut.
Running requests also ask for a block of room beyond the step (BlockNeed.lookahead, granted from
spare blocks only), and the Scheduler counts the room each one holds (`Request.capacity`): a step
that admits nobody and whose tokens all fit skips the round trip, so steady decoding asks the
BlockManager about once every block_size steps instead of every step.

Output: a request's new tokens go to the Engine in the TokensOut of the step that sampled them,
but those of a final_only request without stop strings (SamplingParams.output_kind) wait in
`unsent` until it finishes, and go out once every `final_only_flush_s` while it runs: a batch of
whole completions then costs the Engine and its clients no message per step.

Overlap (async_scheduling): while the Worker runs step N, step N+1 is planned and allocated, so
the Worker goes from one step to the next without waiting for a round trip. Such a step assumes
each request that samples in step N gets one token (the Worker already has it: the persistent
batch appends what it samples) and leaves out those that step N ends by length. It is
allocated with `overlapped=True`: nobody is preempted or swapped, and forks wait, so a request
in flight never loses its blocks; if the running requests do not fit, the BlockManager refuses
the whole step and the Scheduler plans again, the normal way, once step N is done. A request
that step N ends (stop token, abort) is computed once more by step N+1 and that token dropped.
Blocks freed meanwhile may go to others only from step N+2 on, which the Worker runs after step
N+1, so a step never sees its blocks rewritten.

The budget goes to every running decode first, then to running prefill chunks, then to waiting
requests by (priority, arrival). Since max_num_batched_tokens >= max_num_seqs (checked at start),
a running decode is never skipped: however long a prompt, it delays each decode by at most one
step whose size is bounded by the token budget. A waiting request of higher priority than the
lowest running one takes that one's seat when none is free (the displaced one is recomputed).
Preemption victims (the tail of AllocateStep.needs) are the lowest priority, then either the
fewest computed tokens (least work lost, the default) or the last admitted.

Recovery: on Reset(epoch) the Scheduler forgets every request, forwards Reset to the BlockManager
and Worker (which clear theirs) and sends Recover to the Engine, which re-submits its journal.
Allocations and StepResults of another epoch are stale and dropped.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import sys
import time
from collections import deque
from collections.abc import Iterator

import msgspec

from ..messages.blocks import AllocateStep, Allocation, BlockNeed, FreeBlocks
from ..messages.client import EngineStats
from ..messages.codec import SchedulerInbox
from ..messages.common import FinishReason
from ..messages.control import Recover, Reset
from ..messages.step import (
    AbortRequests,
    AddRequest,
    NewRequest,
    RequestOutput,
    RunningUpdate,
    StatsQuery,
    StepPlan,
    StepResult,
    TokensOut,
)
from .config import WORKER_STEPS
from .request_state import Request
from .runtime import Actor, actor_main
from .step_trace import EventTrace

CANDIDATE_TOKENS_PER_BUDGET_TOKEN = 16


class Scheduler(Actor):
    name = "scheduler"
    inbox = SchedulerInbox

    def __init__(self, config):
        super().__init__(config)
        self.eos_token_ids = config.facts.eos_token_ids
        self.max_model_len = config.max_model_len
        self.epoch = config.epoch
        self.arrivals = itertools.count()
        self._clear()
        self.counters = EngineStats()  # the Scheduler's counters (the BlockManager adds its own)
        self.victim_order = Request.victim_order(config.preemption_victim)  # sort key, last first
        self.last_flush = time.monotonic()  # when held final_only outputs last went out
        self.trace = EventTrace(config.step_trace, ".scheduler")
        self.schedule_queued = False  # see _schedule_after_inbox

    def _clear(self) -> None:
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.worker_knows: set[str] = set()  # in the Worker's persistent batch
        self.removed: list[str] = []  # to drop from the Worker's batch with the next plan
        self.step_id = 0
        self.pending: dict[str, Request] | None = None  # awaiting Allocation
        self.pending_told: dict[str, int] = {}  # running requests' told_block_manager before it
        self.pending_overlapped = False
        self.overlap_paused = False  # an overlapped step came to nothing: wait for the Worker
        # steps the Worker has or will run, oldest first: (step id, [(request, tokens)])
        self.in_flight: deque[tuple[int, list[tuple[Request, int]]]] = deque()

    def on_reset(self, message: Reset) -> None:
        self.log.warning(
            "reset to epoch %d: dropping %d requests for the Engine to re-submit",
            message.epoch,
            len(self.requests),
        )
        self.epoch = message.epoch
        self._clear()
        self.send("block_manager", message)
        self.send(WORKER_STEPS, message)
        self.send("engine", Recover(message.epoch, message.actor))

    # -- requests in and out -----------------------------------------------------------------

    def on_add_request(self, message: AddRequest) -> None:
        if message.request_id in self.requests:
            return  # a re-sent request (the Engine's journal) that is already here
        request = Request(message, self.eos_token_ids, next(self.arrivals), self.max_model_len)
        self.requests[request.request_id] = request
        self._enqueue(request)
        self.counters.prompt_tokens += request.num_prompt_tokens
        self._schedule_after_inbox()

    def _schedule_after_inbox(self) -> None:
        """schedule() once the messages already queued in the mailbox are handled (the mailbox
        hands them over without yielding to the loop): requests submitted together, as an
        offline batch's, start in the same step instead of the first one alone."""
        if not self.schedule_queued:
            self.schedule_queued = True
            asyncio.get_running_loop().call_soon(self._scheduled_after_inbox)

    def _scheduled_after_inbox(self) -> None:
        self.schedule_queued = False
        self.schedule()

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.queue_key)

    def on_abort_requests(self, message: AbortRequests) -> None:
        aborted = [self.requests[rid] for rid in message.request_ids if rid in self.requests]
        for request in aborted:
            self._finish(request)
        if aborted:
            outputs = self._last_outputs(aborted, FinishReason.ABORT)
            self.send("engine", TokensOut(self.epoch, outputs))

    @staticmethod
    def _last_outputs(requests: list[Request], reason: FinishReason) -> list[RequestOutput]:
        outputs = [request.take_output() for request in requests]
        for output in outputs:
            output.finish_reason = reason
        return outputs

    def _finish(self, request: Request) -> None:
        """Forget a request; its blocks go back to the pool (FreeBlocks precedes any new step)."""
        rid = request.request_id
        del self.requests[rid]
        if rid in self.running:
            del self.running[rid]
        else:
            self.waiting.remove(request)
        self._forget_in_worker(rid)
        self.send("block_manager", FreeBlocks(self.epoch, [rid]))

    def _forget_in_worker(self, rid: str) -> None:
        if rid in self.worker_knows:
            self.worker_knows.discard(rid)
            self.removed.append(rid)

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
        self._forget_in_worker(request.request_id)
        self._enqueue(request)
        self.counters.num_preemptions += 1
        self.counters.num_swaps += swapped

    def on_stats_query(self, message: StatsQuery) -> None:
        message.stats = msgspec.structs.replace(
            self.counters, num_running=len(self.running), num_waiting=len(self.waiting)
        )
        self.send("block_manager", message)

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> None:
        """Plan the next step: with no step in flight, or (async_scheduling) while one runs."""
        if self.pending is not None or not (self.running or self.waiting):
            return
        overlapped = bool(self.in_flight)
        if overlapped and (
            len(self.in_flight) > 1 or self.overlap_paused or not self.config.async_scheduling
        ):
            return
        if overlapped and self._wants_a_quiet_step():
            return  # planned once the step in flight is done
        if not overlapped:
            self._make_seats()
        budget = self.config.max_num_batched_tokens
        counts: dict[str, int] = {}
        running: dict[str, Request] = {}
        held = True  # every count fits in the blocks its request holds
        for request, unscheduled in self._decodes_first():
            if budget <= 0:
                break
            if request.ends_in_flight():
                continue
            count = unscheduled if unscheduled < budget else budget
            if count > 0:
                rid = request.request_id
                counts[rid] = count
                running[rid] = request
                budget -= count
                held = held and request.num_scheduled + count <= request.capacity
        admissions = self._offer_waiting(overlapped, budget)
        if running and not admissions and held:
            self._plan_in_held_blocks(running, counts, overlapped)
            return
        pending = dict(running)
        self.pending_told = {rid: r.told_block_manager for rid, r in pending.items()}
        needs = [
            r.block_need(counts[r.request_id], False, self.config.block_size)
            for r in sorted(pending.values(), key=self.victim_order)
        ]
        for need, request in admissions:
            needs.append(need)
            pending[request.request_id] = request
        if not needs:
            return
        self.step_id += 1
        self.counters.num_block_round_trips += 1
        self.pending = pending
        self.pending_overlapped = overlapped
        self.trace.mark(self.step_id, "allocate_out")
        self.send(
            "block_manager",
            AllocateStep(self.epoch, self.step_id, needs, budget, overlapped=overlapped),
        )

    def _decodes_first(self) -> Iterator[tuple[Request, int]]:
        """The running requests with their tokens left to schedule: those with at most one
        (decodes) first, then the others, each in running order."""
        chunks = []
        for request in self.running.values():
            unscheduled = request.num_unscheduled
            if unscheduled > 1:
                chunks.append((request, unscheduled))
            else:
                yield request, unscheduled
        yield from chunks

    def _offer_waiting(self, overlapped: bool, budget: int) -> list[tuple[BlockNeed, Request]]:
        """Waiting requests to offer the BlockManager, in queue order, with their needs. It
        spends the budget on what is left after prefix-cache hits, so more prompt tokens than
        the budget are offered (bounded, to keep the message small while a long queue waits)."""
        offers = []
        seats = self.config.max_num_seqs - len(self.running)
        offered, cap = 0, CANDIDATE_TOKENS_PER_BUDGET_TOKEN * self.config.max_num_batched_tokens
        for request in self.waiting:
            if seats <= 0 or budget <= 0 or offered >= cap:
                break
            if overlapped and (request.swapped or request.fork_of is not None):
                break  # swap-ins and forks wait for a step planned the normal way
            if request.fork_of is not None:
                need = self._fork_need(request)
                if need is None:
                    continue  # its sample 0 has not computed the prompt yet
            else:
                count = len(request.token_ids) - request.num_computed
                need = request.block_need(count, True, self.config.block_size)
                offered += count
            offers.append((need, request))
            seats -= 1
        return offers

    def _plan_in_held_blocks(
        self, running: dict[str, Request], counts: dict[str, int], overlapped: bool
    ) -> None:
        """A step of running requests only, each within the blocks it holds: no AllocateStep."""
        self.step_id += 1
        plan = StepPlan(self.epoch, self.step_id, self.removed, [], [])
        self.removed = []
        in_flight = []
        for rid, request in running.items():
            count = counts[rid]
            request.schedule_tokens(request.num_scheduled, count)
            in_flight.append((request, count))
            plan.running.append(RunningUpdate(rid, [], count))
        self._launch(plan, in_flight, overlapped)

    def _launch(self, plan: StepPlan, in_flight: list[tuple[Request, int]], overlapped: bool):
        self.in_flight.append((self.step_id, in_flight))
        self.counters.num_overlapped_steps += overlapped
        self.trace.mark(self.step_id, "plan_out")
        self.send(WORKER_STEPS, plan)
        self.schedule()  # the next step, planned while this one runs

    def _fork_need(self, request: Request) -> BlockNeed | None:
        """A forked sample shares its sample 0's prompt KV (copy-on-write of the partial last
        block) and recomputes only the last prompt token, for its own first draw."""
        parent = self.running.get(request.fork_of)
        if parent is None:
            if request.fork_of not in self.requests:  # sample 0 is gone: compute the prompt
                request.fork_of = None
                return request.block_need(len(request.token_ids), True, self.config.block_size)
            return None
        if parent.num_computed < request.num_prompt_tokens:
            return None
        request.told_block_manager = len(request.token_ids)
        shared = request.num_prompt_tokens - 1
        return BlockNeed(
            request.request_id,
            shared,
            1,
            True,
            list(request.token_ids),
            fork_of=parent.request_id,
            cache_salt=request.params.cache_salt,  # its own later blocks hash in the salt's chain
        )

    def _wants_a_quiet_step(self) -> bool:
        """What only a step planned with nothing in flight may do comes first: a seat taken
        from a lower priority, a swap-in or a fork at the head of the queue."""
        if not self.waiting:
            return False
        head = self.waiting[0]
        if len(self.running) >= self.config.max_num_seqs:
            return head.priority < max(r.priority for r in self.running.values())
        return head.swapped or head.fork_of is not None

    def _make_seats(self) -> None:
        """Waiting requests of higher priority displace the lowest-priority running ones."""
        while self.waiting and len(self.running) >= self.config.max_num_seqs:
            worst = max(self.running.values(), key=lambda r: r.queue_key)
            if self.waiting[0].priority >= worst.priority:
                return
            self.send("block_manager", FreeBlocks(self.epoch, [worst.request_id]))
            self._preempt(worst, swapped=False)

    def on_allocation(self, message: Allocation) -> None:
        self.trace.mark(message.step_id, "allocation_in")
        if message.epoch != self.epoch or message.step_id != self.step_id or self.pending is None:
            return  # stale: from before a reset
        pending, self.pending = self.pending, None
        # Denied: the BlockManager did not take this need's tokens. A new request starts over;
        # a running one (an overlapped step the BlockManager refused whole) is as before it.
        for rid in message.denied:
            if rid in self.requests:
                self.requests[rid].told_block_manager = self.pending_told.get(rid, 0)
        for rids, swapped in ((message.preempted, False), (message.swapped, True)):
            for rid in rids:
                if rid in self.requests:  # else aborted while the allocation was on its way
                    self._preempt(self.requests[rid], swapped)
        plan = StepPlan(
            self.epoch,
            self.step_id,
            self.removed,
            [],
            [],
            message.swap_out,
            message.swap_in,
            message.copies,
        )
        self.removed = []
        in_flight: list[tuple[Request, int]] = []
        for grant in message.granted:
            request = pending[grant.request_id]
            if grant.request_id not in self.requests:
                continue  # aborted meanwhile; its FreeBlocks followed the AllocateStep
            in_flight.append((request, grant.num_new_tokens))
            request.schedule_tokens(grant.num_computed, grant.num_new_tokens)
            room = len(grant.block_ids) * self.config.block_size
            if grant.request_id in self.worker_knows:  # block_ids: its new blocks
                request.capacity += room
                plan.running.append(
                    RunningUpdate(grant.request_id, grant.block_ids, grant.num_new_tokens)
                )
                continue
            if grant.request_id not in self.running:
                self.waiting.remove(request)
                self.running[request.request_id] = request
                if request.cached_tokens is None:
                    request.cached_tokens = grant.num_computed
                request.fork_of = None
                request.swapped = False
                request.num_computed = grant.num_computed
            self.worker_knows.add(request.request_id)
            request.capacity = room  # block_ids: its whole table
            plan.new.append(
                NewRequest(
                    request_id=request.request_id,
                    token_ids=list(request.token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=grant.block_ids,
                    num_new_tokens=grant.num_new_tokens,
                    params=request.params,
                    num_computed_tokens=grant.num_computed,
                )
            )
        if not in_flight:  # everything was preempted, denied or refused
            if plan.removed or plan.swap_out:
                plan.swap_in = []
                self.send(WORKER_STEPS, plan)
            if self.pending_overlapped:  # wait for the step in flight (unless it is done)
                self.overlap_paused = True
                self.schedule()
            elif message.preempted or message.swapped:  # the pool changed: try again
                self.schedule()
            return
        self._launch(plan, in_flight, self.pending_overlapped)

    def on_step_result(self, message: StepResult) -> None:
        self.trace.mark(message.step_id, "result_in")
        stale = message.epoch != self.epoch or not self.in_flight
        if stale or message.step_id != self.in_flight[0][0]:
            return  # from before a reset
        _, in_flight = self.in_flight.popleft()
        self.overlap_paused = False
        self.counters.num_steps += 1
        if message.error is not None:
            self.report_error(f"step {message.step_id} failed in the worker: {message.error}")
            failed = [r for r, _ in in_flight if self.requests.get(r.request_id) is r]
            outputs = self._last_outputs(failed, FinishReason.ERROR)
            for request in failed:
                self._finish(request)
        else:
            outputs = self._apply(in_flight, message)
        self._flush_held(outputs)
        self.schedule()
        if outputs:
            self.send("engine", TokensOut(self.epoch, outputs))

    def _apply(self, in_flight: list[tuple[Request, int]], result: StepResult):
        for request, count in in_flight:
            if self.requests.get(request.request_id) is not request:
                continue  # finished or aborted while the step ran
            request.num_computed += count
            if request.num_computed < len(request.token_ids):
                self.counters.num_partial_prefills += 1
        for chunk in result.prompt_logprobs:
            request = self.requests.get(chunk.request_id)
            gathered = request.prompt_logprobs if request is not None else None
            if gathered is not None and chunk.start <= len(gathered):  # a recompute repeats some
                gathered.extend(chunk.entries[len(gathered) - chunk.start :])
        outputs, generated, requests = [], 0, self.requests
        logprobs = result.logprobs or itertools.repeat(None)
        for rid, token, lp in zip(result.request_ids, result.token_ids, logprobs):
            request = requests.get(rid)
            if request is None:  # finished or aborted while the step ran
                continue
            request.samples_in_flight -= 1
            request.token_ids.append(token)
            generated += 1
            output = request.take_output()
            output.token_ids.append(token)
            if lp is not None:
                output.logprobs.append(lp)
            if request.prompt_logprobs is not None:
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            reason = request.finish_reason()
            if reason is None and request.holds_output:
                request.unsent = output
                continue
            output.finish_reason = reason
            if reason is not None:
                output.cached_tokens = request.cached_tokens or 0
                self._finish(request)
            outputs.append(output)
        self.counters.generation_tokens += generated
        return outputs

    def _flush_held(self, outputs: list[RequestOutput]) -> None:
        """Every final_only_flush_s, add what final_only requests hold, so clients hear of them."""
        now = time.monotonic()
        if now - self.last_flush < self.config.final_only_flush_s:
            return
        self.last_flush = now
        outputs.extend(r.take_output() for r in self.requests.values() if r.unsent is not None)


if __name__ == "__main__":
    actor_main(Scheduler, sys.argv[1])
