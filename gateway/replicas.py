"""Data-parallel replicas behind one gateway: which engine stack each request goes to, and where
a stream goes on when its replica dies.

Routing (`choose_replica`, pure): a prompt of at least one full block of `block_size` tokens has a
prefix key, a hash of its first full blocks, at most `route_prefix_blocks` of them. Rendezvous
hashing maps the key to the replica with the highest blake2b(key || replica index): requests
sharing those blocks (a system prompt) land on one replica, whose prefix cache then holds them,
and a replica leaving moves only its own keys. That replica is taken unless its load (this
gateway's requests in flight there: running + waiting) exceeds the least-loaded usable replica's
by more than `route_load_margin`; then the least loaded takes it, as does every prompt shorter
than one block. A replica that is down (its stream failed with EngineUnavailable, its health
check failed, it refused a request as unavailable: draining) gets no new requests until a health
check answers again.

Failover (`ReplicaSet.generate`): a stream whose replica fails it as unavailable goes on on
another usable replica as a resumption (GenerateRequest.resume with the tokens each sample has
received, the same the SDK sends an Engine that restarted), so its output is the fault-free one
for greedy and seeded requests. With one replica there is nowhere to go: the error is raised.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import AsyncIterator, Callable, Sequence

from ..messages.client import Delta, EngineStats, HealthReply, ResumedSample
from ..messages.common import SamplingParams
from .client import AsyncClient
from .errors import EngineError, EngineUnavailable


def prefix_key(token_ids: Sequence[int], block_size: int, max_blocks: int) -> bytes | None:
    """The hash of the prompt's first full blocks (at most `max_blocks`); None under one block.
    (Not the BlockManager's chained block hashes, actors/block_hash.py, which the gateway may
    not import: any hash of the same tokens keys a route as well.)"""
    full = min(len(token_ids) // block_size, max_blocks) * block_size
    if full == 0:
        return None
    return hashlib.blake2b(array("q", token_ids[:full]).tobytes(), digest_size=16).digest()


def _rendezvous_weight(key: bytes, index: int) -> bytes:
    return hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=8).digest()


def choose_replica(
    key: bytes | None, loads: Sequence[int], usable: Sequence[bool], margin: int
) -> int | None:
    """The replica (index) for a request with prefix `key`; None when no replica is usable.
    `loads[i]`: requests in flight on replica i. The affine replica (rendezvous hashing over the
    usable ones) unless its load exceeds the least load by more than `margin`; then, and without
    a key, the least loaded (the lowest index among equals)."""
    candidates = [i for i, ok in enumerate(usable) if ok]
    if not candidates:
        return None
    least = min(candidates, key=lambda i: (loads[i], i))
    if key is None:
        return least
    affine = max(candidates, key=lambda i: _rendezvous_weight(key, i))
    return affine if loads[affine] - loads[least] <= margin else least


def _failover_worthy(exc: EngineError) -> bool:
    """A failure of the replica, not of the request: another replica may serve it."""
    return isinstance(exc, EngineUnavailable) or exc.code == "unavailable"


class Replica:
    def __init__(self, index: int, client: AsyncClient):
        self.index = index
        self.client = client
        self.in_flight = 0  # this gateway's requests there, not ended
        self.routed = 0  # requests (and resumptions) sent there
        self.up = True


class ReplicaSet:
    """The replicas, as one client: `generate` routes and fails over, `health` merges theirs.
    `tokenize`: text -> token ids, for the prefix key of a text prompt (only with two or more
    replicas: one has no choice to make)."""

    def __init__(
        self,
        clients: list[AsyncClient],
        block_size: int,
        prefix_blocks: int,
        load_margin: int,
        recheck_interval_s: float,
        tokenize: Callable[[str], list[int]] | None = None,
    ):
        self.replicas = [Replica(i, c) for i, c in enumerate(clients)]
        self.serving: dict[str, Replica] = {}  # request id -> the replica streaming it now
        self.recheck_interval_s = recheck_interval_s
        self._rechecks: dict[int, asyncio.Task] = {}
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.load_margin = load_margin
        self.tokenize = tokenize

    def choose(self, key: bytes | None) -> Replica | None:
        loads = [r.in_flight for r in self.replicas]
        index = choose_replica(key, loads, [r.up for r in self.replicas], self.load_margin)
        return None if index is None else self.replicas[index]

    async def _key(self, prompt: str | list[int]) -> bytes | None:
        if len(self.replicas) < 2:
            return None
        if isinstance(prompt, str):
            if self.tokenize is None:
                return None
            # the head of a long prompt is enough for its first blocks unless its tokens average
            # over 16 characters: then the key covers fewer blocks, the same for the same head
            head = prompt[: self.block_size * self.prefix_blocks * 16]
            prompt = await asyncio.to_thread(self.tokenize, head)
        return prefix_key(prompt, self.block_size, self.prefix_blocks)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Delta]:
        """AsyncClient.generate on the chosen replica, resumed on another if that one fails."""
        params = params or SamplingParams()
        key = await self._key(prompt)
        n = max(1, params.n)
        received: dict[int, list[int]] = {}
        done: set[int] = set()
        resume: list[ResumedSample] | None = None
        replica = self.choose(key) or self.replicas[0]  # none up: the SDK says why
        while True:
            current = replica
            current.in_flight += 1
            current.routed += 1
            if request_id is not None:
                self.serving[request_id] = current
            stream = current.client.generate(prompt, params, request_id, priority, resume)
            try:
                async for delta in stream:
                    received.setdefault(delta.index, []).extend(delta.token_ids)
                    if delta.finished:
                        done.add(delta.index)
                    yield delta
                return
            except EngineError as exc:
                if not _failover_worthy(exc):
                    raise
                self.mark_down(current)
                successor = self.choose(key)
                if successor is None:
                    raise
                replica = successor
                resume = [  # copies: `received` grows on with the next replica's tokens
                    ResumedSample(i, list(received.get(i, []))) for i in range(n) if i not in done
                ]
            finally:
                current.in_flight -= 1
                if request_id is not None and self.serving.get(request_id) is current:
                    del self.serving[request_id]
                await stream.aclose()  # the SDK aborts a request left before it finished

    async def abort(self, request_id: str) -> None:
        """AsyncClient.abort on the replica serving `request_id` (on every replica when none
        is known to: it may have ended, and an abort of an unknown id is a no-op there)."""
        replica = self.serving.get(request_id)
        for target in self.replicas if replica is None else [replica]:
            await target.client.abort(request_id)

    def mark_down(self, replica: Replica) -> None:
        """No new requests for `replica` until it answers a health check (asked every
        recheck_interval_s)."""
        replica.up = False
        task = self._rechecks.get(replica.index)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._recheck(replica))
            self._rechecks[replica.index] = task

    async def _recheck(self, replica: Replica) -> None:
        while not replica.up:
            await asyncio.sleep(self.recheck_interval_s)
            try:
                replica.up = (await replica.client.health(self.recheck_interval_s)).ok
            except EngineError:
                pass

    async def health(self, timeout_s: float = 10.0) -> HealthReply:
        """Every replica's health at once: ok when all answer ok, the stats summed, the actors of
        all; replicas that answer are up again, those that do not are down. Raises the first
        replica's error when none answers."""
        replies = await asyncio.gather(
            *(r.client.health(timeout_s) for r in self.replicas), return_exceptions=True
        )
        answered: list[HealthReply] = []
        for replica, reply in zip(self.replicas, replies, strict=True):
            if isinstance(reply, HealthReply):
                replica.up = True
                answered.append(reply)
            elif isinstance(reply, EngineError):
                self.mark_down(replica)
            else:
                raise reply
        if not answered:
            raise replies[0]
        if len(self.replicas) == 1:
            return answered[0]
        return HealthReply(
            answered[0].request_id,
            ok=len(answered) == len(self.replicas) and all(r.ok for r in answered),
            stats=sum_stats([r.stats for r in answered]),
            actors=[a for r in answered for a in r.actors],
        )

    async def close(self) -> None:
        for task in self._rechecks.values():
            task.cancel()
        for replica in self.replicas:
            await replica.client.close()


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' counters and gauges added up (every field of EngineStats is a count)."""
    fields = EngineStats.__struct_fields__
    return EngineStats(**{f: sum(getattr(s, f) for s in stats) for f in fields})
