"""The KV block pool: ref-counted blocks, one block table per request, prefix caching, swap space.

Invariants (checked by tests/test_block_pool.py after every operation):
- a block with ref_count 0 is in the free queue; a block with ref_count k > 0 appears k times
  across all block tables and is not in the free queue;
- a request whose table has n blocks has room for n * block_size tokens;
- a full block of a request may carry a hash chained over all tokens up to its end
  (blake2b of the parent hash and its tokens, the first block's parent the root of the request's
  cache salt: see block_hash.py); `cached` maps such hashes to blocks, and a cached block keeps
  its content until it is handed out again as a fresh block (evicted least-recently-freed first).
A new request reuses the longest chain of cached full blocks whose tokens match, always leaving
at least one prompt token to compute (the step that computes it produces the logits).
Swapped-out requests hold CPU blocks instead (a plain free list: CPU blocks are never cached).
`events` (the BlockManager's KvEventLog, kv_events.py), when set, hears of every hash that enters
or leaves `cached`, in order: what the gateways' indexes of this cache are built from.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ...messages.blocks import Allocation, BlockNeed, Grant
from ..runtime.block_hash import NO_SALT, chain_hashes, chain_root
from ..runtime.config import EngineConfig

if TYPE_CHECKING:
    from .kv_events import KvEventLog


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.parent: bytes | None = None
        self.tokens: tuple[int, ...] = ()


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        swap: bool = False,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(num_blocks * watermark)
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # chained hash -> block id
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # what the pool has been told of each request
        # (full blocks hashed, last hash: the salt's root before any): set on admission
        self.chain: dict[str, tuple[int, bytes]] = {}
        self.swap = swap
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.swapped: dict[str, list[int]] = {}  # request -> its CPU blocks, in order
        self.num_forks = 0  # samples that took another sample's prompt blocks
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found
        self.events: KvEventLog | None = None

    @classmethod
    def for_config(cls, config: EngineConfig) -> BlockPool:
        """The pool of a resolved config (num_kv_blocks known), as the BlockManager keeps it."""
        return cls(
            config.num_kv_blocks,
            config.block_size,
            prefix_caching=config.enable_prefix_caching,
            num_cpu_blocks=config.num_cpu_blocks or 0,
            swap=config.preemption_mode == "swap",
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cpu_free(self) -> int:
        return len(self._cpu_free)

    # -- blocks --------------------------------------------------------------------------------

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.removed(block.hash)
            block.hash = block.parent = None
            block.tokens = ()
        block.ref_count = 1
        return block_id

    def _take_cached(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each; the last blocks of a table are evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs to hold `num_tokens` tokens in total."""
        have = len(self.tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, request_id: str, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"allocate {count} blocks with {len(self._free)} free")
        new = [self._take_fresh() for _ in range(count)]
        self.tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Return a request's blocks (GPU and CPU); unknown ids are a no-op (idempotent)."""
        self.tokens.pop(request_id, None)
        self.chain.pop(request_id, None)
        self._cpu_free.extend(reversed(self.swapped.pop(request_id, [])))
        blocks = self.tables.pop(request_id, None)
        if not blocks:
            return 0
        self._release(blocks)
        return len(blocks)

    # -- prefix cache --------------------------------------------------------------------------

    def _chain(self, tokens: list[int], count: int, parent: bytes, start: int = 0):
        """Yield (hash, parent hash, block tokens) for full blocks start..count-1."""
        bs = self.block_size
        hashes = chain_hashes(parent, tokens[start * bs : count * bs], bs)
        for i, h in enumerate(hashes, start):
            yield h, parent, tuple(tokens[i * bs : (i + 1) * bs])
            parent = h

    def _lookup(self, tokens: list[int], root: bytes = NO_SALT) -> list[int]:
        """Blocks holding the longest cached prefix of `tokens` in the chain from `root` (its
        cache salt's), leaving >= 1 token to compute."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        usable = (len(tokens) - 1) // self.block_size
        for h, parent, chunk in self._chain(tokens, usable, root):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.tokens != chunk or block.parent != parent:
                break  # a hash collision: the tokens do not match
            hits.append(block_id)
        return hits

    def _register(self, request_id: str, num_tokens: int) -> None:
        """Hash the request's blocks that are full once `num_tokens` are computed."""
        if not self.prefix_caching:
            return
        table, tokens = self.tables[request_id], self.tokens[request_id]
        done, parent = self.chain.get(request_id, (0, NO_SALT))
        full = min(num_tokens, len(tokens)) // self.block_size
        for i, (h, parent_h, chunk) in enumerate(self._chain(tokens, full, parent, done), done):
            block = self.blocks[table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.parent, block.tokens = h, parent_h, chunk
                self.cached[h] = block.block_id
                if self.events is not None:
                    self.events.stored(parent_h, h)
            parent = h
        self.chain[request_id] = (max(full, done), parent)

    # -- one step --------------------------------------------------------------------------

    def allocate_step(
        self,
        needs: list[BlockNeed],
        new_token_budget: int = 1 << 30,
        overlapped: bool = False,
        epoch: int = 0,
        step_id: int = 0,
    ) -> Allocation:
        """Allocate for one step's needs, given in priority order; see `AllocateStep`.

        overlapped: the previous step still runs, so nobody may be preempted: unless the running
        requests' blocks all fit, change nothing and deny every need."""
        if overlapped:
            running = [n for n in needs if not n.is_new]
            want = sum(
                self.blocks_needed(n.request_id, n.num_computed + n.num_new_tokens) for n in running
            )
            if want > len(self._free) or any(n.request_id not in self.tables for n in running):
                return Allocation(epoch, step_id, [], [], [n.request_id for n in needs])
        out = Allocation(epoch, step_id, [], [], [])
        budget = new_token_budget
        gone: set[str] = set()
        tail = len(needs)  # needs[tail:] are preempted running requests
        for index, need in enumerate(needs):
            rid = need.request_id
            if rid in gone:
                continue
            if need.is_new:
                grant = None if out.denied or budget <= 0 else self._admit(need, out, budget)
                if grant is None:
                    out.denied.append(rid)
                else:
                    out.granted.append(grant)
                    budget -= grant.num_new_tokens
                continue
            self.tokens[rid].extend(need.token_ids)
            target = need.num_computed + need.num_new_tokens
            want = self.blocks_needed(rid, target)
            while want > len(self._free) and tail > index + 1:
                tail -= 1
                victim = needs[tail]
                if not victim.is_new and victim.request_id not in gone:
                    gone.add(victim.request_id)
                    self._preempt(victim.request_id, out)
            if want <= len(self._free):
                new = self.allocate(rid, want)
                self._register(rid, target)
                out.granted.append(Grant(rid, new, need.num_computed, need.num_new_tokens))
            else:
                gone.add(rid)
                self._preempt(rid, out)
        self._look_ahead(needs, out)
        return out

    def _look_ahead(self, needs: list[BlockNeed], out: Allocation) -> None:
        """After every need is met: room for `lookahead` more tokens for the running requests
        granted, in priority order, from free blocks above the watermark only."""
        room = {n.request_id: n.lookahead for n in needs if not n.is_new and n.lookahead > 0}
        for grant in out.granted:
            if grant.request_id not in room:
                continue
            target = grant.num_computed + grant.num_new_tokens + room[grant.request_id]
            want = self.blocks_needed(grant.request_id, target)
            if want > len(self._free) - self.watermark_blocks:
                return
            grant.block_ids.extend(self.allocate(grant.request_id, want))

    def _preempt(self, request_id: str, out: Allocation) -> None:
        pairs = self.swap_out(request_id) if self.swap else None
        if pairs is None:
            self.free(request_id)
            out.preempted.append(request_id)
        else:
            out.swapped.append(request_id)
            out.swap_out.extend(pairs)

    def _admit(self, need: BlockNeed, out: Allocation, budget: int) -> Grant | None:
        """A waiting request: swap its KV back in, or reuse cached prefix blocks and allocate
        for at most `budget` more tokens; None when it does not fit (it waits)."""
        rid, tokens = need.request_id, list(need.token_ids)
        root = chain_root(need.cache_salt)
        chained = (0, root)  # what is hashed of its chain: (re)hash its blocks from the root
        if rid in self.swapped:
            computed, count = need.num_computed, min(need.num_new_tokens, budget)
            # it may hold more blocks than its tokens need (lookahead room swapped out with it)
            extra = max(0, -(-(computed + count) // self.block_size) - len(self.swapped[rid]))
            if not self._admits(len(self.swapped[rid]) + extra):
                return None
            out.swap_in.extend(self.swap_in(rid))
            self.allocate(rid, extra)
            self.tokens[rid] = tokens
        elif need.fork_of is not None:
            if need.fork_of not in self.tables:  # preempted in this very step: try later
                return None
            computed, count = need.num_computed, min(need.num_new_tokens, budget)
            if self._fork(need.fork_of, rid, computed, computed + count, out) is None:
                return None
            self.tokens[rid] = tokens
        else:
            lookup = need.num_computed == 0 and not need.no_prefix_hits
            hits = self._lookup(tokens, root) if lookup else []
            computed = max(need.num_computed, len(hits) * self.block_size)
            count = min(need.num_new_tokens, len(tokens) - computed, budget)
            want = -(-(computed + count) // self.block_size) - len(hits)
            reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
            if not self._admits(want + reclaimed):
                return None
            if need.num_computed == 0:
                self.query_tokens += len(tokens)
                self.hit_tokens += len(hits) * self.block_size
            for block_id in hits:
                self._take_cached(block_id)
            self.tables[rid] = list(hits)
            self.tokens[rid] = tokens
            self.allocate(rid, want)
            if hits:  # the lookup hashed these already
                chained = (len(hits), self.blocks[hits[-1]].hash)
        self.chain[rid] = chained
        self._register(rid, computed + count)
        return Grant(rid, list(self.tables[rid]), computed, count)

    def _fork(self, parent: str, child: str, shared_tokens: int, target: int, out: Allocation):
        """Give `child` the blocks holding `parent`'s first `shared_tokens` tokens (ref counted)
        and room for `target` tokens. The block the child writes first is copied when it is
        shared and only partly the child's (copy-on-write); None when blocks are short."""
        bs = self.block_size
        shared = self.tables[parent][: -(-shared_tokens // bs)]
        partial = shared_tokens % bs != 0  # the child writes into the last shared block
        want = -(-target // bs) - len(shared) + partial
        if not self._admits(want):
            return None
        for block_id in shared:
            self._take_cached(block_id)
        self.tables[child] = list(shared)
        if partial:
            src = shared[-1]
            dst = self._take_fresh()
            self.tables[child][-1] = dst
            self._release([src])
            out.copies.append((src, dst))
            want -= 1
        self.allocate(child, want)
        self.num_forks += 1
        return self.tables[child]

    def _admits(self, want: int) -> bool:
        """A new request keeps a watermark of free blocks, unless the pool is otherwise idle."""
        if not self.tables:
            return want <= len(self._free)
        return want <= len(self._free) - self.watermark_blocks

    # -- swap ----------------------------------------------------------------------------------

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move a request's KV to CPU blocks: [(gpu block, cpu block)] to copy, or None when
        swap space is short (then the caller recomputes instead)."""
        table = self.tables.get(request_id, [])
        if len(table) > len(self._cpu_free):
            return None
        cpu = [self._cpu_free.pop() for _ in table]
        self.swapped[request_id] = cpu
        self.tables.pop(request_id)
        self.tokens.pop(request_id, None)
        self.chain.pop(request_id, None)
        self._release(table)
        return list(zip(table, cpu))

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: [(cpu block, gpu block)] to copy, or None if short."""
        cpu = self.swapped.get(request_id)
        if cpu is None or len(cpu) > len(self._free):
            return None
        del self.swapped[request_id]
        gpu = self.allocate(request_id, len(cpu))
        self._cpu_free.extend(reversed(cpu))
        return list(zip(cpu, gpu))
