"""Scheduler actor: continuous batching, one step in flight at a time.

Inbox: AddRequest, AbortRequests, StatsQuery (Engine); Allocation (BlockManager); StepResult
(Worker); Reset (supervisor, after a restart); Stop.
Outbox: AllocateStep, FreeBlocks, StatsQuery, Reset -> BlockManager; StepPlan, Reset -> Worker;
TokensOut, Recover -> Engine.
Owns: the waiting queue and running set, every request's tokens and computed-token count.
Dies when: Stop, SIGTERM, or its supervisor goes away.

A step: pick requests under `max_num_seqs` and `max_num_batched_tokens` (running ones first,
decodes before prefill chunks, then waiting ones in FCFS order; a prompt longer than what is left
of the budget is prefilled in chunks) -> one AllocateStep round trip (the BlockManager preempts
from the tail when blocks run out) -> StepPlan with only what changed -> StepResult -> stop checks
-> TokensOut. Blocks are freed only between steps, so no block is reused while a step runs on it.

Recovery: on Reset(epoch) the Scheduler forgets every request, forwards Reset to the BlockManager
and Worker (which clear theirs) and sends Recover to the Engine, which re-submits its journal.
Allocations and StepResults of another epoch are stale and dropped.
"""

from __future__ import annotations

import sys
from collections import deque

from ..messages.blocks import AllocateStep, Allocation, BlockNeed, FreeBlocks
from ..messages.codec import SchedulerInbox
from ..messages.common import FinishReason, SamplingParams
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
from .runtime import Actor, actor_main


class Request:
    """The Scheduler's view of one request. `token_ids` = prompt + sampled tokens."""

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "num_computed", "stops")

    def __init__(self, message: AddRequest, eos_token_ids: list[int]):
        self.request_id = message.request_id
        self.token_ids = list(message.prompt_token_ids) + list(message.output_token_ids)
        self.num_prompt_tokens = len(message.prompt_token_ids)
        self.params: SamplingParams = message.params
        self.num_computed = 0
        stops = set(message.params.stop_token_ids)
        if not message.params.ignore_eos:
            stops.update(eos_token_ids)
        self.stops = frozenset(stops)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def finish_reason(self, max_model_len: int) -> FinishReason | None:
        """Checked after each sampled token: stop tokens (after min_tokens), then length limits."""
        if self.num_output >= self.params.min_tokens and self.token_ids[-1] in self.stops:
            return FinishReason.STOP
        if self.num_output >= self.params.max_tokens or len(self.token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None


class Scheduler(Actor):
    name = "scheduler"
    inbox = SchedulerInbox

    def __init__(self, config):
        super().__init__(config)
        self.eos_token_ids = config.facts.eos_token_ids
        self.max_model_len = config.max_model_len
        self.epoch = config.epoch
        self._clear()
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_partial_prefills = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def _clear(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # admission order
        self.requests: dict[str, Request] = {}
        self.worker_knows: set[str] = set()  # in the Worker's persistent batch
        self.removed: list[str] = []  # to drop from the Worker's batch with the next plan
        self.step_id = 0
        self.pending: dict[str, int] | None = None  # request -> tokens, awaiting Allocation
        self.in_flight: list[tuple[Request, int]] | None = None  # awaiting StepResult

    def on_reset(self, message: Reset) -> None:
        self.log.warning(
            "reset to epoch %d: dropping %d requests for the Engine to re-submit",
            message.epoch,
            len(self.requests),
        )
        self.epoch = message.epoch
        self._clear()
        self.send("block_manager", message)
        self.send("worker", message)
        self.send("engine", Recover(message.epoch))

    # -- requests in and out -----------------------------------------------------------------

    def on_add_request(self, message: AddRequest) -> None:
        if message.request_id in self.requests:
            return  # a re-sent request (the Engine's journal) that is already here
        request = Request(message, self.eos_token_ids)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.prompt_tokens += request.num_prompt_tokens
        self.schedule()

    def on_abort_requests(self, message: AbortRequests) -> None:
        aborted = [self.requests[rid] for rid in message.request_ids if rid in self.requests]
        for request in aborted:
            self._finish(request)
        if aborted:
            self.send(
                "engine",
                TokensOut([RequestOutput(r.request_id, [], FinishReason.ABORT) for r in aborted]),
            )

    def _finish(self, request: Request) -> None:
        """Forget a request; its blocks go back to the pool (FreeBlocks precedes any new step)."""
        rid = request.request_id
        del self.requests[rid]
        if rid in self.running:
            del self.running[rid]
        else:
            self.waiting.remove(request)
        if rid in self.worker_knows:
            self.worker_knows.discard(rid)
            self.removed.append(rid)
        self.send("block_manager", FreeBlocks(self.epoch, [rid]))

    def on_stats_query(self, message: StatsQuery) -> None:
        stats = message.stats
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.num_preemptions = self.num_preemptions
        stats.num_steps = self.num_steps
        stats.num_partial_prefills = self.num_partial_prefills
        stats.prompt_tokens = self.prompt_tokens
        stats.generation_tokens = self.generation_tokens
        self.send("block_manager", message)

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> None:
        """Start the next step unless one is in flight or nothing is waiting or running."""
        if self.pending is not None or self.in_flight is not None:
            return
        if not self.running and not self.waiting:
            return
        budget = self.config.max_num_batched_tokens
        needs: list[BlockNeed] = []
        pending: dict[str, int] = {}
        running = sorted(self.running.values(), key=lambda r: len(r.token_ids) - r.num_computed > 1)
        for request in running:  # decodes first (stable sort), then prefill chunks
            count = min(len(request.token_ids) - request.num_computed, budget)
            if count <= 0:
                break
            needs.append(BlockNeed(request.request_id, request.num_computed + count, False))
            pending[request.request_id] = count
            budget -= count
        seats = self.config.max_num_seqs - len(self.running)
        for request in self.waiting:
            if seats <= 0 or budget <= 0:
                break
            count = min(len(request.token_ids) - request.num_computed, budget)
            needs.append(BlockNeed(request.request_id, request.num_computed + count, True))
            pending[request.request_id] = count
            budget -= count
            seats -= 1
        self.step_id += 1
        self.pending = pending
        self.send("block_manager", AllocateStep(self.epoch, self.step_id, needs))

    def on_allocation(self, message: Allocation) -> None:
        if message.epoch != self.epoch or message.step_id != self.step_id or self.pending is None:
            return  # stale: from before a reset
        pending, self.pending = self.pending, None
        for rid in reversed(message.preempted):  # back to the queue's front, in order
            if rid not in self.requests:  # aborted while the allocation was on its way
                continue
            request = self.running.pop(rid)
            request.num_computed = 0
            self.waiting.appendleft(request)
            if rid in self.worker_knows:
                self.worker_knows.discard(rid)
                self.removed.append(rid)
            self.num_preemptions += 1
        plan = StepPlan(self.epoch, self.step_id, self.removed, [], [])
        self.removed = []
        in_flight: list[tuple[Request, int]] = []
        for grant in message.granted:
            request = self.requests.get(grant.request_id)
            if request is None:  # aborted meanwhile; its FreeBlocks followed the AllocateStep
                continue
            count = pending[grant.request_id]
            in_flight.append((request, count))
            if grant.request_id in self.worker_knows:
                plan.running.append(RunningUpdate(grant.request_id, grant.new_block_ids, count))
                continue
            if grant.request_id not in self.running:
                self.waiting.remove(request)
                self.running[request.request_id] = request
            self.worker_knows.add(request.request_id)
            plan.new.append(
                NewRequest(
                    request_id=request.request_id,
                    token_ids=list(request.token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=grant.new_block_ids,
                    num_new_tokens=count,
                    params=request.params,
                )
            )
        if not in_flight:  # everything was preempted or denied: the pool changed, try again
            if plan.removed:
                self.send("worker", plan)
            if message.preempted:
                self.schedule()
            return
        self.in_flight = in_flight
        self.send("worker", plan)

    def on_step_result(self, message: StepResult) -> None:
        if message.epoch != self.epoch or message.step_id != self.step_id or not self.in_flight:
            return  # stale: from before a reset
        in_flight, self.in_flight = self.in_flight, None
        self.num_steps += 1
        if message.error is not None:
            self.report_error(f"step {message.step_id} failed in the worker: {message.error}")
            outputs = [
                RequestOutput(r.request_id, [], FinishReason.ERROR)
                for r, _ in in_flight
                if r.request_id in self.requests
            ]
            for request, _ in in_flight:
                if request.request_id in self.requests:
                    self._finish(request)
        else:
            outputs = self._apply(in_flight, message)
        if outputs:
            self.send("engine", TokensOut(outputs))
        self.schedule()

    def _apply(
        self, in_flight: list[tuple[Request, int]], result: StepResult
    ) -> list[RequestOutput]:
        for request, count in in_flight:
            request.num_computed += count
            if request.num_computed < len(request.token_ids):
                self.num_partial_prefills += 1
        outputs = []
        for rid, token in zip(result.request_ids, result.token_ids):
            request = self.requests.get(rid)
            if request is None:  # aborted while the step ran
                continue
            request.token_ids.append(token)
            self.generation_tokens += 1
            reason = request.finish_reason(self.max_model_len)
            outputs.append(RequestOutput(rid, [token], reason))
            if reason is not None:
                self._finish(request)
        return outputs


if __name__ == "__main__":
    actor_main(Scheduler, sys.argv[1])
