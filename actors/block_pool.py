"""The KV block pool: a free list and one block table per request.

Invariant: every block id in [0, num_blocks) is either in the free list or in exactly one table,
and a request with a table of k blocks has room for k * block_size tokens.
"""

from __future__ import annotations

from collections import deque

from ..messages.blocks import BlockNeed, Grant


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(num_blocks * watermark)
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs to hold `num_tokens` tokens in total."""
        have = len(self.tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, request_id: str, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"allocate {count} blocks with {len(self._free)} free")
        new = [self._free.popleft() for _ in range(count)]
        self.tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Return a request's blocks to the pool; unknown ids are a no-op (frees are idempotent)."""
        blocks = self.tables.pop(request_id, None)
        if not blocks:
            return 0
        self._free.extend(blocks)
        return len(blocks)

    def allocate_step(self, needs: list[BlockNeed]) -> tuple[list[Grant], list[str], list[str]]:
        """Allocate for one step's needs, given in priority order; see `AllocateStep`.

        Returns (granted, preempted, denied). Preempted requests have lost all their blocks.
        """
        granted: list[Grant] = []
        preempted: list[str] = []
        denied: list[str] = []
        gone: set[str] = set()
        tail = len(needs)  # needs[tail:] are preempted running requests
        for index, need in enumerate(needs):
            rid = need.request_id
            if rid in gone:
                continue
            want = self.blocks_needed(rid, need.num_tokens)
            if need.is_new:
                if denied or not self._admits(want):
                    denied.append(rid)
                else:
                    granted.append(Grant(rid, self.allocate(rid, want)))
                continue
            while want > len(self._free) and tail > index + 1:
                tail -= 1
                victim = needs[tail]
                if not victim.is_new and victim.request_id not in gone:
                    self.free(victim.request_id)
                    gone.add(victim.request_id)
                    preempted.append(victim.request_id)
            if want <= len(self._free):
                granted.append(Grant(rid, self.allocate(rid, want)))
            else:
                self.free(rid)
                gone.add(rid)
                preempted.append(rid)
        return granted, preempted, denied

    def _admits(self, want: int) -> bool:
        """A new request keeps a watermark of free blocks, unless the pool is otherwise idle."""
        if not self.tables:
            return want <= len(self._free)
        return want <= len(self._free) - self.watermark_blocks
