"""Poison quarantine: a request that keeps killing an actor is failed, not replayed for ever.

After a restart the Engine re-submits its journal (Recover). A request whose every try kills an
actor would then spend the supervisor's restart budget and take the whole server down. So the
Engine counts, for each live request, the consecutive crashes of one actor it was in flight at,
with no progress (a sampled token) in between.

- A request reaches `limit` crashes: it is a suspect. If it is the only suspect of this crash, or
  it was the probe (below), it is failed with a clear error and not re-submitted.
- Several suspects at once cannot be told apart (they were in flight together): they are held
  and re-submitted one at a time, each as the probe, the next once the probe has made progress
  or ended. A probe that crashes the actor again is the culprit.
- Every other request is re-submitted at once: one ordinary fault costs no serial replay.

So a poison request is failed at the `limit`-th crash when it is the only suspect, and at most one
crash later when innocent requests were in flight with it; those complete.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class CrashCount:
    actor: str = ""
    crashes: int = 0  # consecutive crashes of `actor` it was in flight at, without progress
    progressed: bool = False  # sampled a token since its last crash


class Quarantine:
    def __init__(self, limit: int):
        self.limit = limit
        self.counts: dict[str, CrashCount] = {}
        self.held: deque[str] = deque()  # suspects not yet re-submitted, in arrival order
        self.probe: str | None = None  # the one suspect re-submitted, on trial

    def is_held(self, request_id: str) -> bool:
        return request_id in self.held

    def crashed(self, actor: str, in_flight: list[str]) -> tuple[list[str], list[str]]:
        """`actor` was restarted while `in_flight` (live, not held) were submitted: count it.
        Returns (to re-submit now, to fail). Suspects that are neither wait in `held`."""
        suspects = []
        for rid in in_flight:
            count = self.counts.setdefault(rid, CrashCount())
            if count.actor == actor and not count.progressed:
                count.crashes += 1
            else:
                count.actor, count.crashes = actor, 1
            count.progressed = False
            if count.crashes >= self.limit:
                suspects.append(rid)
        probe, self.probe = self.probe, None
        if probe in suspects:
            failed = [probe]
        else:
            failed = suspects if len(suspects) == 1 else []
        for rid in failed:
            del self.counts[rid]
        self.held.extend(rid for rid in suspects if rid not in failed)
        suspected = set(suspects)
        return [rid for rid in in_flight if rid not in suspected], failed

    def progressed(self, request_id: str) -> bool:
        """The request sampled a token. True when it was the probe (release the next one)."""
        count = self.counts.get(request_id)
        if count is not None:
            count.progressed = True
        if request_id == self.probe:
            self.probe = None
            return True
        return False

    def forget(self, request_id: str) -> bool:
        """The request ended. True when it was the probe (release the next one)."""
        self.counts.pop(request_id, None)
        if request_id in self.held:
            self.held.remove(request_id)
        if request_id == self.probe:
            self.probe = None
            return True
        return False

    def next_probe(self) -> str | None:
        """The next held suspect to re-submit, if no probe is on trial."""
        if self.probe is None and self.held:
            self.probe = self.held.popleft()
            return self.probe
        return None
