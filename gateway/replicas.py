"""Data-parallel replicas behind one gateway, as one client: which engine stack each request goes
to, and where a stream goes on when its replica dies.

Routing (`ReplicaSet.choose`): `route_policy` "prefix" (prefix affinity against load and KV use)
and "round_robin" are gateway/replica_choice.py's pure choices, on what the gateway knows of each
replica (gateway/replica_state.py: the requests it sent there, its polled EngineStats).

`route_policy` "kv_events" (`kv`, a KvRouter: gateway/kv_routing.py) sends a request where it
is predicted to add the least to all latencies, its own first: from what each replica's prefix
cache holds (its KV events), its queue (`Replica.queue`: prompt tokens waiting for prefill and
requests decoding, this gateway's counted live, other gateways' from its EngineStats), the rows
decoding there and the tokens each has left (`Replica.decoding`) and its measured step costs
(EngineStats.step_cost). While any usable replica's index is not in step it falls back to
prefix affinity as above.

Failover (`ReplicaSet.generate`): a stream whose replica fails it as unavailable goes on on
another usable replica as a resumption (GenerateRequest.resume with the tokens each sample has
received, the same the SDK sends an Engine that restarted), so its output is the fault-free one
for greedy and seeded requests. With one replica there is nowhere to go: the error is raised.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable

from ..messages.client import Delta, EngineStats, HealthReply, ResumedSample
from ..messages.common import SamplingParams
from .client import AsyncClient
from .errors import EngineError, EngineUnavailable
from .kv_routing import KvRouter
from .replica_choice import choose_replica, next_in_turn, prefix_key, replica_load
from .replica_state import STALE_INTERVALS, Replica


def _failover_worthy(exc: EngineError) -> bool:
    """A failure of the replica, not of the request: another replica may serve it."""
    return isinstance(exc, EngineUnavailable) or exc.code == "unavailable"


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
        self._stream_numbers = itertools.count()  # keys of Replica.streams

    def choose(
        self,
        key: bytes | None,
        hashes: list[bytes] | None = None,
        num_tokens: int = 0,
        out_tokens: int = 1,
        rows: int = 1,
    ) -> Replica | None:
        """`hashes`: the prompt's block chain, for kv_events (None: prefix affinity), of a
        prompt of `num_tokens` tokens, for `rows` samples of up to `out_tokens` tokens."""
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
            queues = [r.queue(max_age) for r in self.replicas]
            index = self.kv.choose(
                hashes,
                num_tokens,
                usable,
                [prefill for prefill, _ in queues],
                [decodes for _, decodes in queues],
                [r.step_cost for r in self.replicas],
                index,
                kv_use,
                self.kv_high,
                loads,
                [r.decoding(max_age) for r in self.replicas],
                out_tokens,
                rows,
            )
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
        for replica in up:
            replica.asking()
        replies = await asyncio.gather(
            *(r.client.health(timeout_s) for r in up), return_exceptions=True
        )
        for replica, reply in zip(up, replies, strict=True):
            if isinstance(reply, HealthReply):
                replica.observe(reply.stats)
            else:
                replica.unanswered()

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
        stream_number = next(self._stream_numbers)

        def left() -> tuple[int, int]:
            """(tokens each sample not done has left, samples not done)."""
            fewest = min((len(received.get(i, [])) for i in range(n) if i not in done), default=0)
            return max(0, params.max_tokens - fewest), n - len(done)

        # none up: the first, and the SDK says why
        replica = self.choose(key, hashes, num_tokens, *left()) or self.replicas[0]
        while True:
            current = replica
            counted = self._routed(current, hashes, num_tokens)
            current.in_flight += 1
            if self.kv is not None:  # the tokens left are kv_events' to price, no one else's
                current.streams[stream_number] = left()
            if request_id is not None:
                self.serving[request_id] = current
            stream = current.client.generate(
                prompt, params, request_id, priority, resume, tenant=tenant
            )
            try:
                async for delta in stream:
                    if counted is not None:
                        self._first_token(current, counted)
                        counted = None
                    received.setdefault(delta.index, []).extend(delta.token_ids)
                    if delta.finished:
                        done.add(delta.index)
                    if self.kv is not None:
                        current.streams[stream_number] = left()
                    yield delta
                return
            except EngineError as exc:
                if not _failover_worthy(exc):
                    raise
                self.mark_down(current)
                successor = self.choose(key, hashes, num_tokens, *left())
                if successor is None:
                    raise
                replica = successor
                resume = [  # copies: `received` grows on with the next replica's tokens
                    ResumedSample(i, list(received.get(i, []))) for i in range(n) if i not in done
                ]
            finally:
                if counted is not None:  # it ended before its first token
                    self._first_token(current, counted)
                current.in_flight -= 1
                current.streams.pop(stream_number, None)
                if request_id is not None and self.serving.get(request_id) is current:
                    del self.serving[request_id]
                await stream.aclose()  # the SDK aborts a request left before it finished

    def _routed(
        self, replica: Replica, hashes: list[bytes] | None, num_tokens: int
    ) -> tuple[int, int]:
        """Count a request sent to `replica` as awaiting its first token, with its prompt tokens
        and those of them not cached there; (uncached, all) as counted."""
        prefill = num_tokens
        if self.kv is not None and hashes is not None:
            prefill = min(num_tokens, self.kv.uncached(replica.index, hashes, num_tokens))
            self.kv.routed(replica.index, hashes)
        replica.routed += 1
        replica.awaiting_first += 1
        replica.prefill_here += prefill
        replica.prompt_here += num_tokens
        replica.prompt_routed += num_tokens
        return prefill, num_tokens

    @staticmethod
    def _first_token(replica: Replica, counted: tuple[int, int]) -> None:
        """Undo `_routed`'s count: the request has its first token (or ended)."""
        replica.awaiting_first -= 1
        replica.prefill_here -= counted[0]
        replica.prompt_here -= counted[1]

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
        replica.forget()
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
        for replica in self.replicas:
            replica.asking()
        replies = await asyncio.gather(
            *(r.client.health(timeout_s) for r in self.replicas), return_exceptions=True
        )
        answered: list[HealthReply] = []
        for replica, reply in zip(self.replicas, replies, strict=True):
            if isinstance(reply, HealthReply):
                replica.up = True
                replica.observe(reply.stats)
                answered.append(reply)
                continue
            replica.unanswered()
            if isinstance(reply, EngineError):
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
    """The replicas' counters and gauges added up (every field of EngineStats but step_cost is a
    count; step costs are each replica's own, and have no sum)."""
    fields = [f for f in EngineStats.__struct_fields__ if f != "step_cost"]
    return EngineStats(**{f: sum(getattr(s, f) for s in stats) for f in fields})
