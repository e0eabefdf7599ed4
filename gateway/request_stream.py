"""The SDK's view of one request in flight: its deltas, merged or collected until the caller
reads them, the tokens each sample has received (for a resumption), and its failure.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from ..messages.client import Delta, GenerateRequest, ResumedSample, join
from .errors import EngineError


def join_samples(deltas: list[Delta]) -> list[Delta]:
    """A request's deltas (its n samples interleaved) -> one joined Delta per sample, by index."""
    parts: dict[int, list[Delta]] = {}
    for delta in deltas:
        parts.setdefault(delta.index, []).append(delta)
    return [join(parts[i]) for i in sorted(parts)]


class RequestStream:
    """Pending output of one request. Streaming: deltas merge, per sample index, while nobody
    reads them, and every delta wakes the reader. Collecting (`collect`, for whole completions):
    every delta is kept and the reader wakes once, when the last sample has finished, so a
    batch of non-streamed requests costs no task wake-up per request per step."""

    def __init__(self, request: GenerateRequest, collect: bool = False):
        """A request sent with `resume` (taken over from another engine) starts with the tokens
        listed there, and with the samples not listed finished: `unfinished` of the n remain."""
        self.request = request  # as first sent
        self.n = max(1, request.params.n)
        self.collect = collect
        self.received: dict[int, list[int]] = {}  # token ids of each sample, for a resume
        self.done: set[int] = set()  # samples that have finished
        if request.resume is not None:
            self.received = {s.index: list(s.output_token_ids) for s in request.resume}
            self.done = set(range(self.n)) - set(self.received)
        self.unfinished = self.n - len(self.done)
        self.resumes = 0  # since its last token
        self.resumed_at = -1  # the last ping sent before its last resumption
        self.pending: dict[int, Delta] = {}
        self.collected: list[Delta] = []
        self.last_push = time.monotonic()  # when a delta last came: a collecting one's liveness
        self.finished = len(self.done)  # samples whose last delta has arrived
        self.error: EngineError | None = None
        self.event = asyncio.Event()

    def push(self, delta: Delta) -> None:
        self.last_push = time.monotonic()
        self.finished += delta.finished
        self.received.setdefault(delta.index, []).extend(delta.token_ids)
        if delta.token_ids:
            self.resumes = 0
        if delta.finished:
            self.done.add(delta.index)
        if self.collect:
            self.collected.append(delta)
            if self.finished >= self.n:
                self.event.set()
            return
        held = self.pending.get(delta.index)
        self.pending[delta.index] = delta if held is None else join([held, delta])
        self.event.set()

    def resumption(self) -> GenerateRequest:
        """The request again, for an Engine that lost it: each unfinished sample with the tokens
        received so far."""
        samples = [
            ResumedSample(i, self.received.get(i, [])) for i in range(self.n) if i not in self.done
        ]
        return msgspec.structs.replace(self.request, resume=samples)

    def fail(self, error: EngineError) -> None:
        if self.finished >= self.n:
            return  # it ended before the failure was noticed
        self.error = error
        self.event.set()
