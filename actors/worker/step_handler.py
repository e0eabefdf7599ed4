"""What a Worker rank does with each message of the steps mailbox (WORKER_STEPS): the same code on
every rank of a tensor-parallel group.

StepPlan: run it, if of the current epoch, and answer its StepResult; CompileGrammar: start the
compile, and answer GrammarReady once it is done; Reset: take its epoch and empty the persistent
batch; Stop: the end of the loop; no bytes at all: rank 0's idle tick (worker.py), nothing to
do. Every rank handles the same bytes in the same order (rank 0 broadcasts them before it
handles them: tp_group.py), so the ranks' persistent batches, grammar matchers and samplers stay
the same, they call the same collectives in the same order, and they sample the same tokens;
only rank 0 has `Replies` and answers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ...messages.codec import DecodeError, Decoder, WorkerStepsInbox
from ...messages.control import Reset, Stop
from ...messages.step import StepPlan, StepResult
from ...messages.structured import CompileGrammar, GrammarReady
from ..runtime.config import EngineConfig
from ..runtime.step_trace import open_trace
from .tp_group import GROUP_BROKEN

if TYPE_CHECKING:
    from .runner import ModelRunner
    from .tensor_parallel import TensorParallel

log = logging.getLogger("worker")


class Replies(Protocol):
    """Where rank 0's answers go (any thread may call these: the compile thread answers)."""

    def step_result(self, result: StepResult) -> None: ...

    def grammar_ready(self, ready: GrammarReady) -> None: ...

    def error(self, message: str) -> None: ...


class StepHandler:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        tp: TensorParallel,
        replies: Replies | None,
        exit_group: Callable[[], None] | None = None,
    ):
        """`replies`: rank 0's; None on a follower, which answers nothing. `exit_group`: how a
        rank of a group ends when its step fails (never returns): rank 0's asks its follower
        watch why first (tp_group.py `exit_broken`); by default, exit GROUP_BROKEN."""
        self.runner = runner
        self.config = config
        self.tp = tp
        self.replies = replies
        self.exit_group = exit_group or _exit_group_broken
        self.epoch = config.epoch  # plans of another epoch than the last Reset's are dropped
        self.handled = 0  # messages (idle ticks included) handled: the liveness stamps' count
        self.decoder: Decoder[StepPlan | CompileGrammar | Reset | Stop] = Decoder(WorkerStepsInbox)
        # in a group, one record per step with its all-reduce time (EngineConfig.step_trace)
        in_group = tp.size > 1
        self.all_reduce_trace = open_trace(config.step_trace, ".all_reduce") if in_group else None

    def handle(self, data: bytes) -> bool:
        """Handle one message's bytes; False once they were Stop."""
        self.handled += 1
        if not data:  # an idle tick: it only keeps the group's broadcast within its timeout
            return True
        try:
            item = self.decoder.decode(data)
        except DecodeError as exc:
            if self.replies is not None:
                self.replies.error(f"could not decode a {len(data)}-byte step: {exc}")
            return True
        if isinstance(item, Stop):
            return False
        if isinstance(item, CompileGrammar):
            self._compile_grammar(item)
        elif isinstance(item, Reset):
            self.epoch = item.epoch
            self.runner.forget_all()
        elif item.epoch == self.epoch:
            self._crash_if_faulty(item)
            result = self._execute(item)
            if self.replies is not None and (item.running or item.new):
                self.replies.step_result(result)
        return True

    def count(self) -> int:
        """The messages handled so far (read from another thread: an int is read whole)."""
        return self.handled

    def _compile_grammar(self, message: CompileGrammar) -> None:
        """Start the compile on the compile thread; rank 0 answers when it is done (a follower's
        step waits for its own compile where the grammar's request arrives first)."""
        replies = self.replies
        if replies is None:
            self.runner.grammars.request(message.spec)
            return
        epoch, spec = message.epoch, message.spec

        def answer(error: str | None) -> None:
            replies.grammar_ready(GrammarReady(epoch, spec, error))

        self.runner.grammars.when_compiled(spec, answer)

    def _crash_if_faulty(self, plan: StepPlan) -> None:
        """The tests' poison request (EngineConfig.fault_crash_on_token_id): a new request whose
        tokens hold that id kills this process at once, as a crash in native code would."""
        token = self.config.fault_crash_on_token_id
        if token is not None and any(token in new.token_ids for new in plan.new):
            log.error("fault_crash_on_token_id %d: crashing, as configured", token)
            os._exit(70)

    def _execute(self, plan: StepPlan) -> StepResult:
        """The plan's StepResult. A single Worker answers a step that raises with
        StepResult.error, drops its requests and serves on. A rank of a group exits instead: it
        cannot tell whether its peers wait in one of the step's collectives (its failure may be
        its own, or a peer's in a collective), and the supervisor restarts the group."""
        before = self.tp.all_reduce_s
        try:
            result = self.runner.execute(plan)
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            if self.tp.size > 1:
                log.error("rank %d: exiting, so that the whole group restarts", self.tp.rank)
                self.exit_group()
            for rid in [u.request_id for u in plan.running] + [n.request_id for n in plan.new]:
                self.runner.forget(rid)
            return StepResult(
                plan.epoch, plan.step_id, [], [], error=f"{type(exc).__name__}: {exc}"
            )
        if self.all_reduce_trace is not None:
            self.all_reduce_trace.record(
                {"step": plan.step_id, "all_reduce_s": self.tp.all_reduce_s - before,
                 "t": time.perf_counter()}
            )  # fmt: skip
        return result


def _exit_group_broken() -> None:
    os._exit(GROUP_BROKEN)
