"""The Engine's health requests waiting for the Scheduler's stats.

Each is answered once: with the stats, or (the Scheduler or BlockManager did not answer within
the Engine's STATS_TIMEOUT_S, e.g. while restarting) without them, and then not ok. The
supervisor's roster gives instants (messages/control.py RosterEntry): the ages in the reply are
computed here, when it is answered.
"""

from __future__ import annotations

import time

from ...messages.client import EngineStats, HealthReply
from ...messages.control import RosterEntry


class HealthQueries:
    def __init__(self) -> None:
        self.waiting: dict[str, tuple[bytes, str]] = {}  # query id -> (client, its request id)
        self.last_id = 0

    def ask(self, identity: bytes, request_id: str) -> str:
        """Record a client's health request; the query id to ask the Scheduler with."""
        self.last_id += 1
        query_id = str(self.last_id)
        self.waiting[query_id] = (identity, request_id)
        return query_id

    def answer(
        self, query_id: str, stats: EngineStats | None, roster: list[RosterEntry]
    ) -> tuple[bytes, HealthReply] | None:
        """The reply and its client, or None where the query was answered already. Ok: stats
        came, and every actor in the supervisor's roster is ready."""
        waiter = self.waiting.pop(query_id, None)
        if waiter is None:
            return None
        identity, request_id = waiter
        now = time.monotonic()
        actors = [entry.status(now) for entry in roster]
        ok = stats is not None and bool(actors) and all(a.state == "ready" for a in actors)
        return identity, HealthReply(request_id, ok, stats or EngineStats(), actors)
