"""What the gateway knows of one replica: the requests it sent there, its last stats, whether it
is up (gateway/replicas.py's ReplicaSet keeps one per replica).

What a replica is judged by (`replica_choice.replica_load`, `Replica.kv_use`): its load is
max(this gateway's requests in flight there, its own running + waiting), the second from its
EngineStats, polled at most every `route_stats_interval_s` (and from every health check). The
replica's own numbers count other gateways' requests too; this gateway's count covers the
requests it sent since the last poll. Its KV use is blocks used / blocks total from the same
stats. Stats older than `STALE_INTERVALS` intervals are not used (load: in flight here only;
KV use: 0). A replica that is down (its stream failed with EngineUnavailable, its health check
failed, it refused a request as unavailable: draining) gets no new requests until a health
check answers again.

kv_events weighs a replica's queue (`Replica.queue`) instead: its prompt tokens waiting for
prefill and its requests decoding now. This gateway's own are counted live (a request counts
from the moment it is routed, so a burst routed between two polls spreads; and stops counting
when it ends, so that stats taken before do not keep a replica that has drained looking busy);
other gateways' are what the replica's stats count beyond what this gateway may have had there
when they were taken (its requests in flight at the ask and every one routed before the
answer), assumed unchanged since. The rows a new request would decode beside (`decoding`): each
of this gateway's requests there with the tokens it has left (`streams`), and the others' rows
from the same stats. Its step costs (`step_cost`) are the last it measured: they
do not go stale with its load.
"""

from __future__ import annotations

import time

from ..messages.client import EngineStats, StepCost
from .client import AsyncClient
from .kv_routing import Decoding

STALE_INTERVALS = 5  # stats older than this many route_stats_interval_s are not used


class Replica:
    def __init__(self, index: int, client: AsyncClient):
        self.index = index
        self.client = client
        self.in_flight = 0  # this gateway's requests there, not ended
        self.awaiting_first = 0  # of which without a first token yet
        self.prefill_here = 0  # their prompt tokens not in its cache (as far as we know)
        self.prompt_here = 0  # their prompt tokens, cached or not
        self.routed = 0  # requests (and resumptions) sent there
        self.prompt_routed = 0  # their prompt tokens
        self.up = True
        self.stats: EngineStats | None = None  # its last answer to a stats poll or health check
        self.stats_at = -float("inf")  # when it came (monotonic)
        # (requests, prompt tokens) of this gateway's that the last stats may count, at most
        self.ours_in_stats = (0, 0)
        # (in_flight, prompt_here, routed, prompt_routed) at the oldest ask not answered yet
        self._asked: tuple[int, int, int, int] | None = None
        self.step_cost: StepCost | None = None  # its last measured one
        # this gateway's requests there, by stream number: (tokens each row has left, rows)
        self.streams: dict[int, tuple[int, int]] = {}

    def forget(self) -> None:
        """Another engine serves as this replica now: what the last one said does not hold."""
        self.stats, self.stats_at, self.step_cost = None, -float("inf"), None

    def asking(self) -> None:
        """Stats are being asked for (call `observe` or `unanswered` with the outcome)."""
        if self._asked is None:
            self._asked = (self.in_flight, self.prompt_here, self.routed, self.prompt_routed)

    def unanswered(self) -> None:
        self._asked = None

    def observe(self, stats: EngineStats) -> None:
        """Its stats, just come: they may count this gateway's requests in flight at the ask
        and every one routed since (even one that ended before the answer came)."""
        self.stats, self.stats_at = stats, time.monotonic()
        asked, self._asked = self._asked, None
        if asked is None:
            self.ours_in_stats = (self.in_flight, self.prompt_here)
        else:
            in_flight, prompt, routed, prompt_routed = asked
            self.ours_in_stats = (
                in_flight + self.routed - routed,
                prompt + self.prompt_routed - prompt_routed,
            )
        if stats.step_cost is not None and stats.step_cost.steps > 0:
            self.step_cost = stats.step_cost

    def fresh_stats(self, max_age_s: float) -> EngineStats | None:
        return self.stats if time.monotonic() - self.stats_at <= max_age_s else None

    def kv_use(self, max_age_s: float) -> float:
        """Blocks used / blocks total, from stats at most `max_age_s` old (else 0)."""
        stats = self.fresh_stats(max_age_s)
        return stats.blocks_used / stats.blocks_total if stats and stats.blocks_total else 0.0

    def queue(self, max_age_s: float) -> tuple[int, int]:
        """(prompt tokens waiting for prefill, requests decoding) there now: this gateway's own,
        and the others' from stats at most `max_age_s` old (their requests count as decoding)."""
        prefill, requests = self._others(max_age_s)
        return self.prefill_here + prefill, self.in_flight - self.awaiting_first + requests

    def decoding(self, max_age_s: float) -> Decoding:
        """The rows a request sent there now would decode beside: this gateway's, each with
        the tokens it has left, and the others' (from stats at most `max_age_s` old)."""
        left = tuple(left for left, rows in self.streams.values() for _ in range(rows))
        return Decoding(left, self._others(max_age_s)[1])

    def _others(self, max_age_s: float) -> tuple[int, int]:
        """(prompt tokens waiting, requests) there of other gateways', from stats at most
        `max_age_s` old: what they count beyond what may be this gateway's."""
        stats = self.fresh_stats(max_age_s)
        if stats is None:
            return 0, 0
        in_flight, prompt = self.ours_in_stats
        return (
            max(0, stats.prefill_tokens_queued - prompt),
            max(0, stats.num_running + stats.num_waiting - in_flight),
        )
