"""BlockManager actor: owns the KV block pool; the Worker owns the memory behind the ids.

Inbox: AllocateStep, FreeBlocks, Reset (Scheduler); StatsQuery (from the Scheduler, for the
Engine); Stop. AllocateStep and FreeBlocks of another epoch than the last Reset's are dropped.
Outbox: Allocation -> Scheduler; StatsReply -> Engine; Ready, Heartbeat -> supervisor; KV
events (a KvEventBatch after each message that changed the prefix cache, a KvSnapshot for each
subscription: kv_events.py) -> its XPUB socket, for the gateways (with `kv_events` on).
Owns: the free list and every request's block table; its KV events' epoch and sequence.
Dies when: Stop, or its supervisor goes away (then by SIGTERM); or an allocation fails (the
pool may be inconsistent): it exits and the supervisor's restart recovers every request.
"""

from __future__ import annotations

import os
import sys

from ...messages.blocks import AllocateStep, FreeBlocks
from ...messages.codec import BlockManagerInbox
from ...messages.control import Ready, Reset
from ...messages.step import StatsQuery, StatsReply
from ..runtime.actor import Actor, actor_main
from .block_pool import BlockPool
from .kv_events import KvEventLog, KvEventPublisher


class BlockManager(Actor):
    name = "block_manager"
    inbox = BlockManagerInbox

    def __init__(self, config):
        super().__init__(config)
        if config.num_kv_blocks is None:
            raise ValueError("num_kv_blocks must be resolved (the Worker's Ready) before start")
        self.epoch = config.epoch
        self.publisher: KvEventPublisher | None = None
        self.pool = self._new_pool()

    def _new_pool(self) -> BlockPool:
        pool = BlockPool.for_config(self.config)
        if self.config.kv_events:
            pool.events = KvEventLog(pool.block_size)
        return pool

    async def setup(self) -> None:
        if self.config.kv_events:
            self.publisher = KvEventPublisher(self.ctx, self.config, lambda: self.pool.cached)
            self.publisher.new_epoch(self.epoch)

    async def background(self) -> None:
        if self.publisher is not None:
            await self.publisher.serve_subscriptions()

    async def teardown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def _publish(self) -> None:
        if self.publisher is not None and self.pool.events is not None:
            self.publisher.publish(self.pool.events.take())

    def ready(self) -> Ready:
        return Ready(actor=self.name, pid=os.getpid(), num_kv_blocks=self.pool.num_blocks)

    def on_reset(self, message: Reset) -> None:
        self.epoch = message.epoch
        self.pool = self._new_pool()
        if self.publisher is not None:
            self.publisher.new_epoch(self.epoch)

    def on_allocate_step(self, message: AllocateStep) -> None:
        if message.epoch != self.epoch:
            return
        try:
            allocation = self.pool.allocate_step(
                message.needs,
                message.new_token_budget,
                message.overlapped,
                self.epoch,
                message.step_id,
            )
        except Exception:
            # The pool may be half changed, and the Scheduler waits for this Allocation: a
            # restart (Reset, the Engine re-submitting every live request) is the way back.
            self.log.exception("allocation failed (step %d); restarting", message.step_id)
            os._exit(1)
        self.send("scheduler", allocation)
        self._publish()

    def on_free_blocks(self, message: FreeBlocks) -> None:
        if message.epoch != self.epoch:
            return
        for request_id in message.request_ids:
            self.pool.free(request_id)

    def on_stats_query(self, message: StatsQuery) -> None:
        stats = message.stats
        stats.blocks_total = self.pool.num_blocks
        stats.blocks_free = self.pool.num_free
        stats.num_forks = self.pool.num_forks
        stats.prefix_query_tokens = self.pool.query_tokens
        stats.prefix_hit_tokens = self.pool.hit_tokens
        self.send("engine", StatsReply(message.query_id, stats))


if __name__ == "__main__":
    actor_main(BlockManager, sys.argv[1])
