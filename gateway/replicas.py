"""Data-parallel replicas behind one gateway: which engine stack each request goes to, and where
a stream goes on when its replica dies.

Routing (`route_policy` "prefix", `choose_replica`, pure): a prompt of at least one full block of
`block_size` tokens has a prefix key, a hash of its first full blocks, at most
`route_prefix_blocks` of them. Rendezvous hashing maps the key to the candidate with the highest
blake2b(key || replica index): requests sharing those blocks (a system prompt) land on one
replica, whose prefix cache then holds them, and a replica leaving moves only its own keys.

What a replica is judged by (`replica_load`, `Replica.kv_use`): its load is
max(this gateway's requests in flight there, its own running + waiting), the second from its
EngineStats, polled at most every `route_stats_interval_s` (and from every health check). The
replica's own numbers count other gateways' requests too; this gateway's count covers the
requests it sent since the last poll. Its KV use is blocks used / blocks total from the same
stats. Stats older than `STALE_INTERVALS` intervals are not used (load: in flight here only;
KV use: 0).

The candidates are the usable replicas whose KV use is at most `route_kv_high`, or every usable
replica when none is under it (a full cache preempts; a replica under it can still take work).
The affine candidate takes the request unless its load exceeds the least-loaded candidate's by
more than `route_load_margin`; then the least loaded takes it, as does every prompt shorter than
one block. A replica that is down (its stream failed with EngineUnavailable, its health check
failed, it refused a request as unavailable: draining) gets no new requests until a health
check answers again. `route_policy` "round_robin" ignores keys, load and KV use: each request
goes to the next usable replica in turn (a baseline for scripts/bench_dp_routing.py).

`route_policy` "kv_events" (`kv`, a KvRouter: gateway/kv_routing.py) routes on what each
replica's prefix cache holds, from its KV events, against its prefill queue and running decodes:
the larger of this gateway's (prompt tokens sent there without a first token yet, requests past
it) and the replica's own (EngineStats). While any usable replica's index is not in step it
falls back to prefix affinity as above.

Failover (`ReplicaSet.generate`): a stream whose replica fails it as unavailable goes on on
another usable replica as a resumption (GenerateRequest.resume with the tokens each sample has
received, the same the SDK sends an Engine that restarted), so its output is the fault-free one
for greedy and seeded requests. With one replica there is nowhere to go: the error is raised.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence

from ..messages.client import Delta, EngineStats, HealthReply, ResumedSample
from ..messages.common import SamplingParams
from .client import AsyncClient
from .errors import EngineError, EngineUnavailable
from .kv_routing import KvRouter

STALE_INTERVALS = 5  # stats older than this many route_stats_interval_s are not used


def prefix_key(token_ids: Sequence[int], block_size: int, max_blocks: int) -> bytes | None:
    """The hash of the prompt's first full blocks (at most `max_blocks`); None under one block.
    (Not the BlockManager's chained block hashes, actors/block_manager/block_hash.py, which the
    gateway may not import: any hash of the same tokens keys a route as well.)"""
    full = min(len(token_ids) // block_size, max_blocks) * block_size
    if full == 0:
        return None
    return hashlib.blake2b(array("q", token_ids[:full]).tobytes(), digest_size=16).digest()


def _rendezvous_weight(key: bytes, index: int) -> bytes:
    return hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=8).digest()


def choose_replica(
    key: bytes | None,
    loads: Sequence[int],
    usable: Sequence[bool],
    margin: int,
    kv_use: Sequence[float] | None = None,
    kv_high: float = 1.0,
) -> int | None:
    """The replica (index) for a request with prefix `key`; None when no replica is usable.
    `loads[i]`: replica i's load (`replica_load`); `kv_use[i]`: its KV cache use, 0..1. The
    candidates: the usable replicas with KV use at most `kv_high`, or all usable ones when none
    is. The affine candidate (rendezvous hashing) unless its load exceeds the least load by more
    than `margin`; then, and without a key, the least loaded (the lowest index among equals)."""
    usable_ones = [i for i, ok in enumerate(usable) if ok]
    if not usable_ones:
        return None
    roomy = [i for i in usable_ones if kv_use is None or kv_use[i] <= kv_high]
    candidates = roomy or usable_ones
    least = min(candidates, key=lambda i: (loads[i], i))
    if key is None:
        return least
    affine = max(candidates, key=lambda i: _rendezvous_weight(key, i))
    return affine if loads[affine] - loads[least] <= margin else least


def next_in_turn(last: int, usable: Sequence[bool]) -> int | None:
    """Round robin: the first usable replica after `last` (wrapping); None when none is."""
    count = len(usable)
    for step in range(1, count + 1):
        i = (last + step) % count
        if usable[i]:
            return i
    return None


def replica_load(in_flight_here: int, stats: EngineStats | None) -> int:
    """A replica's load: this gateway's requests in flight there, or the replica's own running +
    waiting (every gateway's, as of its last stats) when that is more."""
    if stats is None:
        return in_flight_here
    return max(in_flight_here, stats.num_running + stats.num_waiting)


def _failover_worthy(exc: EngineError) -> bool:
    """A failure of the replica, not of the request: another replica may serve it."""
    return isinstance(exc, EngineUnavailable) or exc.code == "unavailable"


class Replica:
    def __init__(self, index: int, client: AsyncClient):
        self.index = index
        self.client = client
        self.in_flight = 0  # this gateway's requests there, not ended
        self.awaiting_first = 0  # of which without a first token yet
        self.prefill_here = 0  # their prompt tokens not in its cache (as far as we know)
        self.routed = 0  # requests (and resumptions) sent there
        self.up = True
        self.stats: EngineStats | None = None  # its last answer to a stats poll or health check
        self.stats_at = -float("inf")  # when it came (monotonic)

    def observe(self, stats: EngineStats) -> None:
        self.stats, self.stats_at = stats, time.monotonic()

    def fresh_stats(self, max_age_s: float) -> EngineStats | None:
        return self.stats if time.monotonic() - self.stats_at <= max_age_s else None

    def kv_use(self, max_age_s: float) -> float:
        """Blocks used / blocks total, from stats at most `max_age_s` old (else 0)."""
        stats = self.fresh_stats(max_age_s)
        return stats.blocks_used / stats.blocks_total if stats and stats.blocks_total else 0.0


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
        *,
        kv_high: float = 0.9,
        stats_interval_s: float | None = None,
        policy: str = "prefix",
        kv: KvRouter | None = None,
    ):
        """`stats_interval_s`: poll the replicas' stats at most this often (None: never; the
        load is then this gateway's requests in flight alone)."""
        self.replicas = [Replica(i, c) for i, c in enumerate(clients)]
        self.serving: dict[str, Replica] = {}  # request id -> the replica streaming it now
        self.recheck_interval_s = recheck_interval_s
        self._rechecks: dict[int, asyncio.Task] = {}
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.load_margin = load_margin
        self.tokenize = tokenize
        self.kv_high = kv_high
        self.stats_interval_s = stats_interval_s
        self.policy = policy
        self.kv = kv if policy == "kv_events" else None
        self._last_turn = -1  # round robin: the replica that took the last request
        self._stats_poll: asyncio.Task | None = None
        self._stats_polled = -float("inf")
        self._retired: list[AsyncClient] = []  # the clients of moved replicas, until closed
        self._closing: set[asyncio.Task] = set()

    def choose(self, key: bytes | None, hashes: list[bytes] | None = None) -> Replica | None:
        """`hashes`: the prompt's block chain, for kv_events (None: prefix affinity)."""
        usable = [r.up for r in self.replicas]
        if self.policy == "round_robin":
            index = next_in_turn(self._last_turn, usable)
            self._last_turn = self._last_turn if index is None else index
            return None if index is None else self.replicas[index]
        self._poll_stats_soon()
        max_age = (self.stats_interval_s or 0.0) * STALE_INTERVALS
        stats = [r.fresh_stats(max_age) for r in self.replicas]
        loads = [replica_load(r.in_flight, s) for r, s in zip(self.replicas, stats, strict=True)]
        kv_use = [r.kv_use(max_age) for r in self.replicas]
        index = choose_replica(key, loads, usable, self.load_margin, kv_use, self.kv_high)
        if self.kv is not None and hashes is not None and self.kv.ready(usable):
            prefill, decodes = [], []
            for replica, replica_stats in zip(self.replicas, stats, strict=True):
                theirs = replica_stats or EngineStats()
                prefill.append(max(replica.prefill_here, theirs.prefill_tokens_queued))
                decoding = replica.in_flight - replica.awaiting_first
                decodes.append(max(decoding, theirs.num_running))
            index = self.kv.choose(hashes, usable, prefill, decodes, index, kv_use, self.kv_high)
        return None if index is None else self.replicas[index]

    def _poll_stats_soon(self) -> None:
        """Ask every usable replica for its stats in the background when the last poll is an
        interval old: a request is routed on the stats at hand, never waits for new ones."""
        if self.stats_interval_s is None or len(self.replicas) < 2:
            return
        now = time.monotonic()
        busy = self._stats_poll is not None and not self._stats_poll.done()
        if busy or now - self._stats_polled < self.stats_interval_s:
            return
        self._stats_polled = now
        self._stats_poll = asyncio.get_running_loop().create_task(self._poll_stats())

    async def _poll_stats(self) -> None:
        """Record the stats of each replica that answers within an interval or two. A replica
        that does not is not marked down here (a busy engine answers late): its streams and
        health checks decide that, and its old stats age out."""
        timeout_s = max(1.0, 2 * (self.stats_interval_s or 0.0))
        up = [r for r in self.replicas if r.up]
        replies = await asyncio.gather(
            *(r.client.health(timeout_s) for r in up), return_exceptions=True
        )
        for replica, reply in zip(up, replies, strict=True):
            if isinstance(reply, HealthReply):
                replica.observe(reply.stats)

    async def _route_keys(
        self, prompt: str | list[int], cache_salt: str | None
    ) -> tuple[bytes | None, list[bytes] | None, int]:
        """(prefix key, block chain for kv_events or None, prompt tokens known)."""
        if len(self.replicas) < 2:
            return None, None, 0
        if isinstance(prompt, str):
            if self.tokenize is None:
                return None, None, 0
            # the head of a long prompt is enough for its first blocks unless its tokens average
            # over 16 characters: then the key covers fewer blocks, the same for the same head
            blocks = self.kv.max_blocks if self.kv is not None else self.prefix_blocks
            head = prompt[: self.block_size * max(blocks, self.prefix_blocks) * 16]
            prompt = await asyncio.to_thread(self.tokenize, head)
        key = prefix_key(prompt, self.block_size, self.prefix_blocks)
        hashes = self.kv.hashes(prompt, cache_salt) if self.kv is not None else None
        return key, hashes, len(prompt)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> AsyncIterator[Delta]:
        """AsyncClient.generate on the chosen replica, resumed on another if that one fails."""
        params = params or SamplingParams()
        key, hashes, num_tokens = await self._route_keys(prompt, params.cache_salt)
        n = max(1, params.n)
        received: dict[int, list[int]] = {}
        done: set[int] = set()
        resume: list[ResumedSample] | None = None
        replica = self.choose(key, hashes) or self.replicas[0]  # none up: the SDK says why
        while True:
            current = replica
            prefill = self._routed(current, hashes, num_tokens)
            current.in_flight += 1
            current.routed += 1
            if request_id is not None:
                self.serving[request_id] = current
            stream = current.client.generate(
                prompt, params, request_id, priority, resume, tenant=tenant
            )
            try:
                async for delta in stream:
                    if prefill is not None:
                        self._first_token(current, prefill)
                        prefill = None
                    received.setdefault(delta.index, []).extend(delta.token_ids)
                    if delta.finished:
                        done.add(delta.index)
                    yield delta
                return
            except EngineError as exc:
                if not _failover_worthy(exc):
                    raise
                self.mark_down(current)
                successor = self.choose(key, hashes)
                if successor is None:
                    raise
                replica = successor
                resume = [  # copies: `received` grows on with the next replica's tokens
                    ResumedSample(i, list(received.get(i, []))) for i in range(n) if i not in done
                ]
            finally:
                if prefill is not None:  # it ended before its first token
                    self._first_token(current, prefill)
                current.in_flight -= 1
                if request_id is not None and self.serving.get(request_id) is current:
                    del self.serving[request_id]
                await stream.aclose()  # the SDK aborts a request left before it finished

    def _routed(self, replica: Replica, hashes: list[bytes] | None, num_tokens: int) -> int:
        """Count a request sent to `replica` as awaiting its first token, with its prompt
        tokens not cached there; the prefill so counted."""
        prefill = num_tokens
        if self.kv is not None and hashes is not None:
            cached = self.kv.indexes[replica.index].cached_prefix_blocks(hashes)
            prefill = max(0, num_tokens - cached * self.block_size)
            self.kv.routed(replica.index, hashes)
        replica.awaiting_first += 1
        replica.prefill_here += prefill
        return prefill

    @staticmethod
    def _first_token(replica: Replica, prefill: int) -> None:
        """Undo `_routed`'s count: the request has its first token (or ended)."""
        replica.awaiting_first -= 1
        replica.prefill_here -= prefill

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

    def lose(self, index: int, reason: str) -> None:
        """Replica `index` is gone (its placement says so): its open streams fail over now, and
        it takes no new request until it answers a health check (after a `move`, at its new
        address)."""
        replica = self.replicas[index]
        replica.client.fail_all(f"is lost: {reason}")
        self.mark_down(replica)

    def move(self, index: int, client: AsyncClient) -> None:
        """Replica `index` now serves through `client` (its placement started a replacement at
        another address): the streams still open on the old one fail over at once, and the
        replacement takes new requests once it answers a health check. The old client closes
        once its streams have let go of it."""
        replica = self.replicas[index]
        old = replica.client
        replica.client = client
        replica.stats, replica.stats_at = None, -float("inf")
        old.fail_all(f"was replaced by replica {index} at {client.address}")
        self.mark_down(replica)
        self._retired.append(old)
        task = asyncio.get_running_loop().create_task(self._close_when_idle(old))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_when_idle(self, client: AsyncClient, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while client.open_streams() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self._retired.remove(client)
        await client.close()

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
                replica.observe(reply.stats)
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
        for task in (*self._rechecks.values(), self._stats_poll, *self._closing):
            if task is None:
                continue
            task.cancel()
        for client in (*(r.client for r in self.replicas), *self._retired):
            await client.close()


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' counters and gauges added up (every field of EngineStats is a count)."""
    fields = EngineStats.__struct_fields__
    return EngineStats(**{f: sum(getattr(s, f) for s in stats) for f in fields})
