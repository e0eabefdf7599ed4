"""Scheduler actor: continuous batching, with up to two steps in flight.

Inbox: AddRequest, AbortRequests, StatsQuery (Engine); Allocation (BlockManager); StepResult,
GrammarReady (Worker); Reset (supervisor, after a restart); Stop.
Outbox: AllocateStep, FreeBlocks, StatsQuery, Reset -> BlockManager; StepPlan, CompileGrammar,
Reset -> the Worker's forward thread (its mailbox WORKER_STEPS); TokensOut, Recover -> Engine.
Owns: the waiting queue and running set, every request's tokens and computed-token count (in its
StepPlanner, actors/scheduler/step_planner.py, which documents how a step is planned), and the
fit of its steps' times (step_cost.py, reported in its stats for the gateways' routing).
Dies when: Stop, or its supervisor goes away (then by SIGTERM).

The actor only moves messages: it hands each to the planner and sends what the planner returns,
the frees first (the BlockManager frees before it allocates the next step). After an arrival it
plans once the messages already in the mailbox are handled, so requests submitted together start
in the same step. A structured request waits for its grammar first (grammar_gate.py).

Output: a request's new tokens go to the Engine in the TokensOut of the step that sampled them,
but those of a final_only request without stop strings (SamplingParams.output_kind) wait in
`Request.unsent` until it finishes, and go out once every `final_only_flush_s` while it runs: a
batch of whole completions then costs the Engine and its clients no message per step.

Recovery: on Reset(epoch) the Scheduler forgets every request, forwards Reset to the BlockManager
and Worker (which clear theirs) and sends Recover to the Engine, which re-submits its journal.
Allocations and StepResults of another epoch are stale and dropped.
"""

from __future__ import annotations

import asyncio
import sys
import time

from msgspec.structs import replace

from ...messages.blocks import AllocateStep, Allocation, FreeBlocks
from ...messages.codec import SchedulerInbox
from ...messages.common import FinishReason
from ...messages.control import Recover, Reset
from ...messages.step import (
    AbortRequests,
    AddRequest,
    RequestOutput,
    StatsQuery,
    StepPlan,
    StepResult,
    TokensOut,
)
from ...messages.structured import CompileGrammar, GrammarReady
from ..runtime.actor import Actor, actor_main
from ..runtime.addresses import WORKER_STEPS
from ..runtime.step_trace import EventTrace
from .grammar_gate import GrammarGate
from .step_planner import StepPlanner


class Scheduler(Actor):
    name = "scheduler"
    inbox = SchedulerInbox

    def __init__(self, config):
        super().__init__(config)
        self.planner = StepPlanner(config)
        self.last_flush = time.monotonic()  # when held final_only outputs last went out
        self.trace = EventTrace(config.step_trace, ".scheduler")
        self.plan_queued = False  # see _plan_after_inbox
        self.grammars = GrammarGate(config.structured_cache_size)

    def on_reset(self, message: Reset) -> None:
        self.log.warning(
            "reset to epoch %d: dropping %d requests for the Engine to re-submit",
            message.epoch,
            len(self.planner.requests),
        )
        self.planner.reset(message.epoch)
        self.grammars.reset()
        self.send("block_manager", message)
        self.send(WORKER_STEPS, message)
        self.send("engine", Recover(message.epoch, message.actor))

    def on_add_request(self, message: AddRequest) -> None:
        if not self.grammars.admits(message):
            spec = self.grammars.park(message)
            if spec is not None:
                self.send(WORKER_STEPS, CompileGrammar(self.planner.epoch, spec))
            return
        self.planner.add(message)
        self._plan_after_inbox()

    def on_grammar_ready(self, message: GrammarReady) -> None:
        if message.epoch != self.planner.epoch:
            return  # asked before a reset: the re-submitted requests asked again
        waiting = self.grammars.compiled(message)
        if message.error is not None:
            error = FinishReason.ERROR
            outputs = [RequestOutput(m.request_id, [], error) for m in waiting]
            if outputs:
                self.send("engine", TokensOut(self.planner.epoch, outputs))
            return
        for parked in waiting:
            self.planner.add(parked)
        self._plan_after_inbox()

    def on_abort_requests(self, message: AbortRequests) -> None:
        self.grammars.drop(message.request_ids)  # the Engine has retired them already
        tokens = self.planner.abort(message)
        self._send_frees()
        if tokens is not None:
            self.send("engine", tokens)

    def on_stats_query(self, message: StatsQuery) -> None:
        planner = self.planner
        running = len(planner.running)
        waiting = len(planner.waiting) + self.grammars.num_parked
        queued = sum(
            max(0, r.num_prompt_tokens - r.num_computed)
            for r in (*planner.running.values(), *planner.waiting)
        )
        message.stats = replace(
            planner.counters,
            num_running=running,
            num_waiting=waiting,
            prefill_tokens_queued=queued,
            step_cost=planner.step_costs.estimate(),
        )
        self.send("block_manager", message)

    def on_allocation(self, message: Allocation) -> None:
        self.trace.mark(message.step_id, "allocation_in")
        if self.planner.is_stale(message):
            return  # from before a reset
        self._send_planned(self.planner.granted(message))
        self._plan()

    def on_step_result(self, message: StepResult) -> None:
        self.trace.mark(message.step_id, "result_in")
        if self.planner.is_stale(message):
            return  # from before a reset
        if message.error is not None:
            self.report_error(f"step {message.step_id} failed in the worker: {message.error}")
        tokens = self.planner.applied(message, flush_held=self._flush_due())
        self._plan()
        self._send_frees()
        if tokens is not None:
            self.send("engine", tokens)

    # -- sending what the planner returns ------------------------------------------------------

    def _plan(self) -> None:
        """Plan steps until the planner has none to plan now (one more may overlap a StepPlan)."""
        while (message := self.planner.plan()) is not None:
            self._send_planned(message)

    def _send_planned(self, message: AllocateStep | StepPlan | None) -> None:
        self._send_frees()
        if isinstance(message, AllocateStep):
            self.trace.mark(message.step_id, "allocate_out")
            self.send("block_manager", message)
        elif message is not None:
            if message.running or message.new:  # else it only drops requests or swaps out
                self.trace.mark(message.step_id, "plan_out")
            self.send(WORKER_STEPS, message)

    def _send_frees(self) -> None:
        frees: FreeBlocks | None = self.planner.take_frees()
        if frees is not None:
            self.send("block_manager", frees)

    def _plan_after_inbox(self) -> None:
        """Plan once the messages already queued in the mailbox are handled (the mailbox hands
        them over without yielding to the loop): requests submitted together, as an offline
        batch's, start in the same step instead of the first one alone."""
        if not self.plan_queued:
            self.plan_queued = True
            asyncio.get_running_loop().call_soon(self._planned_after_inbox)

    def _planned_after_inbox(self) -> None:
        self.plan_queued = False
        self._plan()

    def _flush_due(self) -> bool:
        """Whether final_only_flush_s has passed since held outputs last went out (then now)."""
        now = time.monotonic()
        if now - self.last_flush < self.config.final_only_flush_s:
            return False
        self.last_flush = now
        return True


if __name__ == "__main__":
    actor_main(Scheduler, sys.argv[1])
