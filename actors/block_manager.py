"""BlockManager actor: owns the KV block pool; the Worker owns the memory behind the ids.

Inbox: AllocateStep, FreeBlocks, Reset (Scheduler); StatsQuery (from the Scheduler, for the
Engine); Stop. AllocateStep and FreeBlocks of another epoch than the last Reset's are dropped.
Outbox: Allocation -> Scheduler; StatsReply -> Engine; Ready, Heartbeat -> supervisor.
Owns: the free list and every request's block table.
Dies when: Stop, SIGTERM, or its supervisor goes away.
"""

from __future__ import annotations

import sys

from ..messages.blocks import AllocateStep, Allocation, FreeBlocks
from ..messages.codec import BlockManagerInbox
from ..messages.control import Ready, Reset
from ..messages.step import StatsQuery, StatsReply
from .block_pool import BlockPool
from .runtime import Actor, actor_main


class BlockManager(Actor):
    name = "block_manager"
    inbox = BlockManagerInbox

    def __init__(self, config):
        super().__init__(config)
        if config.num_kv_blocks is None:
            raise ValueError(
                "num_kv_blocks must be resolved (from the Worker's Ready) before start"
            )
        self.pool = BlockPool(config.num_kv_blocks, config.block_size)
        self.epoch = config.epoch

    def ready(self) -> Ready:
        return Ready(actor=self.name, pid=super().ready().pid, num_kv_blocks=self.pool.num_blocks)

    def on_reset(self, message: Reset) -> None:
        self.epoch = message.epoch
        self.pool = BlockPool(self.pool.num_blocks, self.pool.block_size)

    def on_allocate_step(self, message: AllocateStep) -> None:
        if message.epoch != self.epoch:
            return
        granted, preempted, denied = self.pool.allocate_step(message.needs)
        self.send("scheduler", Allocation(self.epoch, message.step_id, granted, preempted, denied))

    def on_free_blocks(self, message: FreeBlocks) -> None:
        if message.epoch != self.epoch:
            return
        for request_id in message.request_ids:
            self.pool.free(request_id)

    def on_stats_query(self, message: StatsQuery) -> None:
        message.stats.blocks_total = self.pool.num_blocks
        message.stats.blocks_free = self.pool.num_free
        self.send("engine", StatsReply(message.query_id, message.stats))


if __name__ == "__main__":
    actor_main(BlockManager, sys.argv[1])
