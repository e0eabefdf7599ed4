"""Which replica a request goes to under `route_policy` "prefix" and "round_robin", pure
(gateway/replicas.py's ReplicaSet asks; kv_events: gateway/kv_routing.py).

Prefix affinity (`choose_replica`): a prompt of at least one full block of `block_size` tokens
has a prefix key, a hash of its first full blocks, at most `route_prefix_blocks` of them.
Rendezvous hashing maps the key to the candidate with the highest blake2b(key || replica
index): requests sharing those blocks (a system prompt) land on one replica, whose prefix cache
then holds them, and a replica leaving moves only its own keys.

The candidates are the usable replicas whose KV use is at most `route_kv_high`, or every usable
replica when none is under it (a full cache preempts; a replica under it can still take work).
The affine candidate takes the request unless its load (`replica_load`) exceeds the
least-loaded candidate's by more than `route_load_margin`; then the least loaded takes it, as
does every prompt shorter than one block.

Round robin (`next_in_turn`) ignores keys, load and KV use: each request goes to the next usable
replica in turn (a baseline for scripts/bench_dp_routing.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from ..messages.client import EngineStats


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
