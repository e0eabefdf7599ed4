"""How one step's token budget is split among the running requests (step_planner.py's `plan`),
and what it leaves for the waiting ones. Pure.

The budget (max_num_batched_tokens) goes to every running decode first (a request with at most
one token left to schedule), then to running prompt chunks, each in running order; what is left
goes to the newcomers' prompts (the BlockManager spends it, knowing their prefix-cache hits).
With `max_prefill_tokens_beside_decodes`, a step in which any request decodes computes at most
that many prompt tokens, running chunks' and newcomers' together: a prompt is chunked over the
steps after, and each decode's token waits for at most that many prompt tokens' work. A step
with no decode takes prompts up to the whole budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..runtime.config import EngineConfig
from .request_state import Request


@dataclass
class StepBudget:
    """A step's split: `counts` (request id -> tokens this step computes for that running
    request, decodes first, in running order), `running` (the same requests by id, in that
    order), `held` (every count fits in the blocks its request holds), `new_tokens` (what the
    waiting requests' prompts may take)."""

    counts: dict[str, int]
    running: dict[str, Request]
    held: bool
    new_tokens: int


def split_budget(running: Iterable[Request], config: EngineConfig) -> StepBudget:
    budget = config.max_num_batched_tokens
    split = StepBudget({}, {}, True, 0)
    prompt_budget: int | None = None  # prompt tokens this step may still take (None: not known)
    for request, unscheduled in decodes_first(running):
        if budget <= 0:
            break
        if request.ends_in_flight():
            continue
        count = unscheduled if unscheduled < budget else budget
        if unscheduled > 1:  # a prompt chunk: every decode is counted by now
            if prompt_budget is None:
                prompt_budget = prompt_tokens(config, decoding=bool(split.counts))
            count = min(count, prompt_budget)
            prompt_budget -= count
        if count > 0:
            split.counts[request.request_id] = count
            split.running[request.request_id] = request
            budget -= count
            split.held = split.held and request.num_scheduled + count <= request.capacity
    if prompt_budget is None:
        prompt_budget = prompt_tokens(config, decoding=bool(split.counts))
    split.new_tokens = max(0, min(budget, prompt_budget))
    return split


def prompt_tokens(config: EngineConfig, decoding: bool) -> int:
    """The prompt tokens (running chunks' and newcomers') a step may compute: at most
    max_prefill_tokens_beside_decodes when a request decodes in it, else its whole budget."""
    cap = config.max_prefill_tokens_beside_decodes
    if decoding and cap is not None:
        return cap
    return config.max_num_batched_tokens


def decodes_first(running: Iterable[Request]) -> Iterator[tuple[Request, int]]:
    """The running requests with their tokens left to schedule: those with at most one
    (decodes) first, then the others, each in running order."""
    chunks = []
    for request in running:
        unscheduled = request.num_unscheduled
        if unscheduled > 1:
            chunks.append((request, unscheduled))
        else:
            yield request, unscheduled
    yield from chunks
