"""One replica's prefix cache as this gateway knows it: the block hashes its KV events say it holds
(messages/kv_events.py), pure (gateway/kv_events.py feeds it from the socket).

`usable` (route on it) only while the index is in step with the replica's events and whole:
- A snapshot makes it so (the BlockManager sends one for each subscription), as does batch 0 of
  an epoch (AllCleared: the replica's pool was rebuilt empty, a Reset or a restart).
- A batch that is not the next one (a seq gap: ZMQ dropped some for a slow reader; another epoch
  that does not start at 0: the replica restarted while this gateway was away) clears the index:
  it is stale until the snapshot that `apply` asks for by returning True (the subscriber
  re-subscribes); meanwhile routing falls back to prefix affinity. Events until then are not
  applied: nothing would say which of the cleared blocks they build on.
- Over `max_blocks` hashes it evicts the oldest stored and is partial (not usable) until the
  replica's cache is cleared or a snapshot fits: a cache bigger than the cap cannot be followed.
- A replica whose block size is not the gateway's hashes other chains: never usable.
Bytes that do not decode are a lost batch as well (`lost`).

`assume`: the blocks of a prompt just routed here count as held for `assume_s` seconds, until its
events say so (they come when the replica schedules its prefill, which may queue first): else a
burst sharing a new prefix would find it nowhere and spread over every replica.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from ..messages.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlockStored,
    KvEventBatch,
    KvEventMessage,
    KvSnapshot,
)


class ReplicaIndex:
    def __init__(self, max_blocks: int, block_size: int):
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.blocks: dict[bytes, None] = {}  # insertion order: the oldest stored first
        self.epoch: int | None = None
        self.seq = -1
        self.in_step = False  # applying every batch since a snapshot or an epoch's start
        self.partial = False  # blocks evicted for the cap
        self.wrong_block_size = False
        self.newest_ts: float | None = None  # the publisher's clock of the newest message
        self.resyncs = 0  # times it fell out of step
        self.assumed: dict[bytes, float] = {}  # hash -> until when (monotonic), oldest first

    @property
    def usable(self) -> bool:
        return self.in_step and not self.partial and not self.wrong_block_size

    def apply(self, message: KvEventMessage) -> bool:
        """Take one message; True when the index fell out of step (ask for a snapshot)."""
        self.newest_ts = message.ts
        if isinstance(message, KvSnapshot):
            if message.block_size != self.block_size:
                self.wrong_block_size = True
            self._restart(message.epoch, message.seq)
            self._store(message.block_hashes)
            return False
        if self.in_step and message.epoch == self.epoch and message.seq == self.seq + 1:
            self.seq = message.seq
            self._apply_events(message)
            return False
        if message.seq == 0 and message.events and isinstance(message.events[0], AllCleared):
            self._restart(message.epoch, 0)
            self._apply_events(message)
            return False
        if not self.in_step:
            return False  # a snapshot is asked for already
        self.lost()
        return True

    def lost(self) -> None:
        """A batch went missing: clear, and wait for a snapshot."""
        self.blocks.clear()
        self.assumed.clear()
        self.in_step = self.partial = False
        self.epoch, self.seq = None, -1
        self.resyncs += 1

    def _restart(self, epoch: int, seq: int) -> None:
        self.blocks.clear()
        self.assumed.clear()
        self.partial = False
        self.epoch, self.seq, self.in_step = epoch, seq, True

    def _apply_events(self, batch: KvEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    self.wrong_block_size = True
                self._store(event.block_hashes)
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    self.blocks.pop(block_hash, None)
                    self.assumed.pop(block_hash, None)
            else:  # AllCleared
                self.blocks.clear()
                self.assumed.clear()
                self.partial = False

    def _store(self, hashes: Iterable[bytes]) -> None:
        blocks = self.blocks
        for block_hash in hashes:
            blocks.pop(block_hash, None)  # stored again: the newest now
            blocks[block_hash] = None
        while len(blocks) > self.max_blocks:
            del blocks[next(iter(blocks))]
            self.partial = True

    def assume(self, hashes: Sequence[bytes], assume_s: float) -> None:
        """Count `hashes` as held for `assume_s` seconds (a prompt routed here)."""
        if assume_s <= 0:
            return
        now = time.monotonic()
        assumed, until = self.assumed, now + assume_s
        while assumed and next(iter(assumed.values())) < now:  # expired: the oldest first
            del assumed[next(iter(assumed))]
        for block_hash in hashes:
            if block_hash not in self.blocks:
                assumed.pop(block_hash, None)
                assumed[block_hash] = until
        while len(assumed) > self.max_blocks:
            del assumed[next(iter(assumed))]

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of a prompt's first blocks (its chain `hashes`) the replica holds, or is
        assumed to hold."""
        now = time.monotonic()
        count = 0
        for block_hash in hashes:
            if block_hash not in self.blocks and self.assumed.get(block_hash, 0.0) < now:
                break
            count += 1
        return count
