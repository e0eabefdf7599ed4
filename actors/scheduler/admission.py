"""Admission: the waiting queue and what a step offers the BlockManager from it.

Waiting requests (new, preempted or swapped out) are offered in the fair order: by priority;
within a priority, the request of the client (AddRequest.client) that holds the fewest seats,
counting the running requests and those offered before it in the step, then by arrival. So k
clients waiting at one priority are admitted in turn, one request each, from whoever holds
least: one client's backlog, however long, delays another's first request by at most one
admission of its own. A step offers them one per free seat (`max_num_seqs` less the running),
while budget is left, and more prompt tokens than the budget (CANDIDATE_TOKENS_PER_BUDGET_TOKEN
per budget token): the BlockManager spends the budget after prefix-cache hits, which the planner
cannot see. Sample i > 0 of an n > 1 request (a fork) is offered only once sample 0 has computed
the prompt, as a need for its own blocks past the shared ones; until then it is passed over, and
counts for nothing. Swap-ins and forks wait for a step planned with nothing in flight (they move
or share blocks a step in flight may still write).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping

from ...messages.blocks import BlockNeed
from ..runtime.config import EngineConfig
from .request_state import Request

# Waiting requests' prompt tokens offered per token of budget: the BlockManager spends the budget
# after prefix-cache hits, which the planner cannot see.
CANDIDATE_TOKENS_PER_BUDGET_TOKEN = 16


def fair_victim(
    head: Request,
    running: Iterable[Request],
    seats: Mapping[str, int],
    victim_order: Callable[[Request], tuple],
) -> Request | None:
    """The running request whose seat the waiting `head` takes, every seat being taken, for its
    client's fair share (None: it waits): one of `head`'s priority, of the client holding the
    most seats (`seats`), when `head`'s client holds at least two fewer. Seats move towards an
    even share and never back (the giver is left with no fewer than the taker); the victim is
    the giver's last in victim_order (fewest computed tokens or last admitted), recomputed."""
    rivals = [r for r in running if r.priority == head.priority and r.client != head.client]
    if not rivals:
        return None
    most = max(seats[r.client] for r in rivals)
    if seats.get(head.client, 0) + 2 > most:
        return None
    return max((r for r in rivals if seats[r.client] == most), key=victim_order)


class WaitingQueue:
    """The waiting requests, in (priority, arrival) order, and each client's in that order."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._queue: list[Request] = []
        self._of_client: dict[str, list[Request]] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def add(self, request: Request) -> None:
        """At its place by priority and arrival (a preempted request keeps its arrival)."""
        key = Request.queue_key.fget
        bisect.insort(self._queue, request, key=key)
        bisect.insort(self._of_client.setdefault(request.client, []), request, key=key)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        mine = self._of_client[request.client]
        mine.remove(request)
        if not mine:
            del self._of_client[request.client]

    def fair_order(
        self, seats: Mapping[str, int], running: dict[str, Request], requests: dict[str, Request]
    ) -> Iterator[Request]:
        """The waiting requests in the order a step offers them (see the module's docstring),
        forks that wait for their sample 0 left out. `seats`: each client's running requests
        (`running`: the admitted requests; `requests`: every live one, for the forks)."""
        heap = []  # (priority, seats held, arrival) of each client's next request
        for client, mine in self._of_client.items():
            self._push(heap, client, mine, 0, seats.get(client, 0), running, requests)
        while heap:
            _, held, _, client, index = heapq.heappop(heap)
            mine = self._of_client[client]
            yield mine[index]
            self._push(heap, client, mine, index + 1, held + 1, running, requests)

    def _push(
        self,
        heap: list,
        client: str,
        mine: list[Request],
        index: int,
        held: int,
        running: dict[str, Request],
        requests: dict[str, Request],
    ) -> None:
        """The client's next request from `index` on that may be offered, if any, on the heap."""
        while index < len(mine) and self._fork_waits(mine[index], running, requests):
            index += 1
        if index < len(mine):
            heapq.heappush(heap, (mine[index].priority, held, mine[index].arrival, client, index))

    def offers(
        self,
        seats_held: Mapping[str, int],
        running: dict[str, Request],
        requests: dict[str, Request],
        overlapped: bool,
        budget: int,
    ) -> list[tuple[BlockNeed, Request]]:
        """Waiting requests to offer the BlockManager, in the fair order, with their needs
        (`seats_held`, `running`, `requests`: as `fair_order` takes them)."""
        offers = []
        seats = self.config.max_num_seqs - len(running)
        offered, cap = 0, CANDIDATE_TOKENS_PER_BUDGET_TOKEN * self.config.max_num_batched_tokens
        if seats <= 0 or budget <= 0:
            return offers
        for request in self.fair_order(seats_held, running, requests):
            if seats <= 0 or budget <= 0 or offered >= cap:
                break
            if overlapped and (request.swapped or request.fork_of is not None):
                break  # swap-ins and forks wait for a step planned the normal way
            if request.fork_of is not None:
                need = self._fork_need(request, requests)
            else:
                count = len(request.token_ids) - request.num_computed
                need = request.block_need(count, True, self.config.block_size)
                offered += count
            offers.append((need, request))
            seats -= 1
        return offers

    @staticmethod
    def _fork_waits(
        request: Request, running: dict[str, Request], requests: dict[str, Request]
    ) -> bool:
        """A fork whose sample 0 is live but has not computed the prompt yet."""
        if request.fork_of is None or request.fork_of not in requests:
            return False
        parent = running.get(request.fork_of)
        return parent is None or parent.num_computed < request.num_prompt_tokens

    def _fork_need(self, request: Request, requests: dict[str, Request]) -> BlockNeed:
        """A forked sample's need, its sample 0 having computed the prompt or being gone."""
        if request.fork_of not in requests:  # sample 0 is gone: compute the prompt
            request.fork_of = None
            return request.block_need(len(request.token_ids), True, self.config.block_size)
        return request.fork_need()
