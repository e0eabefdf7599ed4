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

from collections.abc import Iterable
from dataclasses import dataclass

from ..runtime.config import EngineConfig
from .request_state import Request


@dataclass
class StepBudget:
    """A step's split: `counts` (request id -> tokens this step computes for that running
    request, decodes first, each kind in running order), `held` (every count fits in the
    blocks its request holds), `new_tokens` (what the waiting requests' prompts may take)."""

    counts: dict[str, int]
    held: bool
    new_tokens: int


def split_budget(running: Iterable[Request], config: EngineConfig) -> StepBudget:
    budget = config.max_num_batched_tokens
    split = StepBudget({}, True, 0)

    def take(request: Request, count: int) -> None:
        split.counts[request.request_id] = count
        split.held = split.held and request.num_scheduled + count <= request.capacity

    decodes, chunks = [], []  # (request, tokens left to schedule): at most one, and more
    for request in running:
        if not request.ends_in_flight():
            unscheduled = request.num_unscheduled
            (chunks if unscheduled > 1 else decodes).append((request, unscheduled))
    for request, unscheduled in decodes:
        count = min(unscheduled, budget)
        if count > 0:
            take(request, count)
            budget -= count
    prompt_left = prompt_tokens(config, decoding=bool(split.counts))
    for request, unscheduled in chunks:
        count = min(unscheduled, budget, prompt_left)
        if count > 0:
            take(request, count)
            budget -= count
            prompt_left -= count
    split.new_tokens = max(0, min(budget, prompt_left))
    return split


def prompt_tokens(config: EngineConfig, decoding: bool) -> int:
    """The prompt tokens (running chunks' and newcomers') a step may compute: at most
    max_prefill_tokens_beside_decodes when a request decodes in it, else its whole budget."""
    cap = config.max_prefill_tokens_beside_decodes
    if decoding and cap is not None:
        return cap
    return config.max_num_batched_tokens
