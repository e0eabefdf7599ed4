"""The Engine's journal: every live request, what lets a restarted actor's work resume.

Requests are keyed by engine id, `key(identity, client's request id)` (live_request.py), so ids
of different clients never collide and a client acts on its own requests only. A request with
n > 1 samples is journaled as n children (engine ids `eid#i`), grouped under the client's id.
A request being prepared (tokenized or its grammar checked, on a thread) is known by its id but
not yet live: an abort or a client's departure meanwhile drops it before it is admitted.
What each client holds (client_shares.py) is counted as its samples are journaled and retired.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...messages.client import GenerateRequest
from ...messages.common import SamplingParams
from .client_shares import ClientShares
from .live_request import LiveRequest, key


class Journal:
    def __init__(self, shares: ClientShares) -> None:
        self.shares = shares
        self.live: dict[str, LiveRequest] = {}  # by engine id (a child's for n > 1)
        self.groups: dict[str, list[str]] = {}  # engine id of an n > 1 request -> live children
        self.preparing: dict[str, GenerateRequest] = {}  # by engine id: on a thread

    def __len__(self) -> int:
        return len(self.live)

    def __iter__(self) -> Iterator[str]:
        return iter(self.live)

    def get(self, request_id: str) -> LiveRequest | None:
        return self.live.get(request_id)

    def knows(self, identity: bytes, request_id: str) -> bool:
        """Whether the client's id names a live request, a group or one being prepared."""
        eid = key(identity, request_id)
        return eid in self.live or eid in self.groups or eid in self.preparing

    def add(self, engine_id: str, entries: list[LiveRequest], grouped: bool) -> None:
        """Journal a request's entries (its samples, or those it resumes); `grouped`: it has
        n > 1 samples."""
        if grouped:
            self.groups[engine_id] = [live.request.request_id for live in entries]
        for live in entries:
            self.live[live.request.request_id] = live
            self.shares.take(live.request)

    def refusal(
        self, client: str, samples: int, num_prompt_tokens: int, params: SamplingParams
    ) -> tuple[str, str] | None:
        """(message, code) when `samples` more live samples of `client` would be over a limit
        on the engine or on one client (ClientShares.refusal); None when they fit."""
        return self.shares.refusal(client, len(self.live), samples, num_prompt_tokens, params)

    def live_children(self, engine_id: str) -> list[str]:
        """The live requests a client's id stands for: its samples, or itself."""
        children = self.groups.get(engine_id) or [engine_id]
        return [cid for cid in children if cid in self.live]

    def retire(self, request_id: str) -> LiveRequest:
        """Drop a finished request (and from its n > 1 group)."""
        live = self.live.pop(request_id)
        self.shares.give_back(live.request)
        group = self.groups.get(live.group_id) if live.group_id else None
        if group is not None:
            group.remove(request_id)
            if not group:
                del self.groups[live.group_id]
        return live

    def of_client(self, identity: bytes) -> list[str]:
        """Every engine id the client has live, grouped or being prepared."""
        prefix = identity.hex() + "/"
        ids = [eid for eid in (*self.groups, *self.live) if eid.startswith(prefix)]
        return ids + [eid for eid in self.preparing if eid.startswith(prefix)]

    def owners(self) -> set[bytes]:
        """The client identities with live requests."""
        return {live.identity for live in self.live.values()}
