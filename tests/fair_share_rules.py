"""The planner's fair share, written again from its docstrings (actors/scheduler/admission.py
and step_planner.py) for tests/step_planner_support.py to check the planner against.

A state is what `Simulation.snapshot` records: the waiting requests (`Waiting`), and of the
running ones their (priority, arrival), victim-order key and client, and each client's seats.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple


class Waiting(NamedTuple):
    request_id: str
    priority: int
    arrival: int
    client: str
    fork_waits: bool  # a fork whose sample 0 has not computed the prompt: passed over


def fair_order(waiting: list[Waiting], seats: dict[str, int]) -> list[str]:
    """The order a step offers waiting requests, from admission.py's docstring: by priority;
    within a priority, the client holding the fewest seats (its running requests, and those
    offered before in the step), then by arrival; forks that wait passed over."""
    held, left, order = Counter(seats), [w for w in waiting if not w.fork_waits], []
    while left:
        best = min(left, key=lambda w: (w.priority, held[w.client], w.arrival))
        order.append(best.request_id)
        held[best.client] += 1
        left.remove(best)
    return order


def head(state: dict) -> Waiting | None:
    """The fair order's first (None: no waiting request may be offered)."""
    order = fair_order(state["waiting"], state["seats"])
    return next((w for w in state["waiting"] if order and w.request_id == order[0]), None)


def seat_taker(state: dict, max_num_seqs: int) -> str | None:
    """The running request whose seat the next waiting one takes, every seat being taken:
    the lowest-priority, last-arrived one if of lower priority than it; else, at its
    priority, the last by victim order of the client holding the most seats, when its own
    client holds at least two fewer."""
    first, running, seats = head(state), state["running"], state["seats"]
    if first is None or len(running) < max_num_seqs:
        return None
    worst = max(running, key=running.get)
    if running[worst][0] > first.priority:
        return worst
    rivals = [
        rid
        for rid in running
        if running[rid][0] == first.priority and state["clients"][rid] != first.client
    ]
    most = max((seats[state["clients"][rid]] for rid in rivals), default=0)
    if seats[first.client] + 2 > most:
        return None
    givers = [rid for rid in rivals if seats[state["clients"][rid]] == most]
    return max(givers, key=state["victim"].get)
