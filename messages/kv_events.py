"""BlockManager -> gateways: what each replica's prefix cache holds, as it changes (its KV events).

The BlockManager publishes on its PUB socket (Addresses.kv_events) one `KvEventBatch` after each
message that changed its cache, and a `KvSnapshot` of everything it holds whenever a subscriber
(re)subscribes. Both carry the BlockManager's `epoch` (its pool is rebuilt empty on every Reset
and every restart, each a new epoch) and `seq`: batches of one epoch are numbered 0, 1, 2, ... and
the first batch of every epoch holds AllCleared; a snapshot carries the seq of the last batch
before it (-1: none yet), so the next batch is seq + 1. A subscriber that sees a seq other than
the next one, or another epoch not starting at 0, has missed events (gateway/kv_index.py).

Hashes are those of actors/runtime/block_hash.py: 16 bytes each, chained from the root of the
request's cache salt, so a gateway computes the same chain for a prompt (of `block_size` tokens a
block) and finds how many of its first blocks a replica holds. `ts`: the publisher's wall clock
(time.time()) when the batch went out, for the index's lag.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Blocks now cached, consecutive in one chain: `block_hashes[0]` follows `parent_hash` (the
    salt's root for a first block), each next one follows the one before."""

    block_hashes: list[bytes]
    parent_hash: bytes
    block_size: int  # tokens per block


class BlocksRemoved(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Blocks whose cached content was evicted (handed out again as fresh blocks)."""

    block_hashes: list[bytes]


class AllCleared(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The cache is empty: a new pool (a Reset, a restarted BlockManager)."""


KvEvent = BlockStored | BlocksRemoved | AllCleared


class KvEventBatch(msgspec.Struct, tag=True, array_like=True, gc=False):
    epoch: int
    seq: int
    ts: float
    events: list[KvEvent]


class KvSnapshot(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Every block the cache holds, as of batch `seq` of `epoch`."""

    epoch: int
    seq: int
    ts: float
    block_size: int
    block_hashes: list[bytes]


KvEventMessage = KvEventBatch | KvSnapshot
