"""Admission: the waiting queue and what a step offers the BlockManager from it.

Waiting requests (new, preempted or swapped out) are kept in (priority, arrival) order. A step
offers them in that order, one per free seat (`max_num_seqs` less the running), while budget is
left, and more prompt tokens than the budget (CANDIDATE_TOKENS_PER_BUDGET_TOKEN per budget token):
the BlockManager spends the budget after prefix-cache hits, which the planner cannot see. Sample
i > 0 of an n > 1 request (a fork) is offered only once sample 0 has computed the prompt, as a
need for its own blocks past the shared ones. Swap-ins and forks wait for a step planned with
nothing in flight (they move or share blocks a step in flight may still write).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from ...messages.blocks import BlockNeed
from ..runtime.config import EngineConfig
from .request_state import Request

# Waiting requests' prompt tokens offered per token of budget: the BlockManager spends the budget
# after prefix-cache hits, which the planner cannot see.
CANDIDATE_TOKENS_PER_BUDGET_TOKEN = 16


class WaitingQueue:
    """The waiting requests, in (priority, arrival) order."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._queue: list[Request] = []

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    def add(self, request: Request) -> None:
        """At its place by priority and arrival (a preempted request keeps its arrival)."""
        bisect.insort(self._queue, request, key=Request.queue_key.fget)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def head_waits_for_quiet(self) -> bool:
        """Whether the head is a swap-in or a fork: only a step planned with nothing in flight
        may admit it."""
        head = self._queue[0]
        return head.swapped or head.fork_of is not None

    def offers(
        self,
        running: dict[str, Request],
        requests: dict[str, Request],
        overlapped: bool,
        budget: int,
    ) -> list[tuple[BlockNeed, Request]]:
        """Waiting requests to offer the BlockManager, in queue order, with their needs
        (`running`: the admitted requests; `requests`: every live one, for the forks)."""
        offers = []
        seats = self.config.max_num_seqs - len(running)
        offered, cap = 0, CANDIDATE_TOKENS_PER_BUDGET_TOKEN * self.config.max_num_batched_tokens
        for request in self._queue:
            if seats <= 0 or budget <= 0 or offered >= cap:
                break
            if overlapped and (request.swapped or request.fork_of is not None):
                break  # swap-ins and forks wait for a step planned the normal way
            if request.fork_of is not None:
                need = self._fork_need(request, running, requests)
                if need is None:
                    continue  # its sample 0 has not computed the prompt yet
            else:
                count = len(request.token_ids) - request.num_computed
                need = request.block_need(count, True, self.config.block_size)
                offered += count
            offers.append((need, request))
            seats -= 1
        return offers

    def _fork_need(
        self, request: Request, running: dict[str, Request], requests: dict[str, Request]
    ) -> BlockNeed | None:
        """A forked sample's need once its sample 0 has computed the prompt (None: not yet)."""
        parent = running.get(request.fork_of)
        if parent is None:
            if request.fork_of not in requests:  # sample 0 is gone: compute the prompt
                request.fork_of = None
                return request.block_need(len(request.token_ids), True, self.config.block_size)
            return None
        if parent.num_computed < request.num_prompt_tokens:
            return None
        return request.fork_need()
