"""Routing on what each replica's prefix cache holds (`route_policy` kv_events), pure.

A request's chain (`prompt_block_hashes`) is the one the BlockManager looks up for it:
actors/runtime/block_hash.py's hashes of its full blocks from its cache salt's root, leaving at
least one prompt token to compute (block_pool.py `_lookup`), at most `max_blocks` of them. Each
replica whose index is usable (kv_index.py) holds the first `cached[i]` of them.

The choice (`choose_by_cache`): among the candidates (the usable replicas with KV use at most
`kv_high`, or all usable ones when none is; as choose_replica's), the highest

    score(i) = cached[i] - (prefill_weight x prefill_tokens[i] + decode_weight x decodes[i])
                           / block_size

cached prefix blocks (prompt blocks it need not compute) against its load in blocks' worth of
work before this request's first token: the prompt tokens queued there for prefill, and the
decodes running there, each of which takes a slot of every step this request's prefill needs.
Ties (no cache anywhere, equal loads) go to `affine`, prefix affinity's choice, so that a prefix
seen nowhere yet starts on one replica, not on whichever is first.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..actors.runtime.block_hash import chain_hashes, chain_root
from .kv_index import ReplicaIndex


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None, max_blocks: int
) -> list[bytes]:
    """The hashes of the prompt's blocks a replica's prefix cache could serve."""
    count = min(max(0, len(token_ids) - 1) // block_size, max_blocks)
    if count == 0:
        return []
    tokens = token_ids[: count * block_size]
    return list(chain_hashes(chain_root(cache_salt), tokens, block_size))


def kv_score(
    cached_blocks: int,
    prefill_tokens: int,
    decodes: int,
    block_size: int,
    prefill_weight: float,
    decode_weight: float,
) -> float:
    return cached_blocks - (prefill_weight * prefill_tokens + decode_weight * decodes) / block_size


def choose_by_cache(
    cached: Sequence[int],
    prefill_tokens: Sequence[int],
    decodes: Sequence[int],
    usable: Sequence[bool],
    block_size: int,
    prefill_weight: float,
    decode_weight: float,
    affine: int | None = None,
    kv_use: Sequence[float] | None = None,
    kv_high: float = 1.0,
) -> int | None:
    """The replica (index) with the best score; None when none is usable."""
    usable_ones = [i for i, ok in enumerate(usable) if ok]
    if not usable_ones:
        return None
    roomy = [i for i in usable_ones if kv_use is None or kv_use[i] <= kv_high]
    candidates = roomy or usable_ones
    scores = {
        i: kv_score(
            cached[i], prefill_tokens[i], decodes[i], block_size, prefill_weight, decode_weight
        )
        for i in candidates
    }
    best = max(scores.values())
    tied = [i for i in candidates if scores[i] == best]
    return affine if affine in tied else tied[0]


class KvRouter:
    """The indexes of the replicas (by position) and the policy's settings: `choose` routes on
    them while every usable replica's index is (`ready`), else the caller falls back to prefix
    affinity. Counts both, for the metrics."""

    def __init__(
        self,
        indexes: list[ReplicaIndex],
        block_size: int,
        max_blocks: int,
        prefill_weight: float,
        decode_weight: float,
        assume_s: float,
    ):
        self.indexes = indexes
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.assume_s = assume_s
        self.by_cache = 0  # requests routed on the indexes
        self.fallbacks = 0  # requests routed by prefix affinity, an index not usable

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        return prompt_block_hashes(token_ids, self.block_size, cache_salt, self.max_blocks)

    def ready(self, usable: Sequence[bool]) -> bool:
        ready = all(index.usable for index, ok in zip(self.indexes, usable, strict=True) if ok)
        if ready:
            self.by_cache += 1
        else:
            self.fallbacks += 1
        return ready

    def choose(
        self,
        hashes: Sequence[bytes],
        usable: Sequence[bool],
        prefill_tokens: Sequence[int],
        decodes: Sequence[int],
        affine: int | None,
        kv_use: Sequence[float] | None = None,
        kv_high: float = 1.0,
    ) -> int | None:
        cached = [index.cached_prefix_blocks(hashes) for index in self.indexes]
        return choose_by_cache(
            cached,
            prefill_tokens,
            decodes,
            usable,
            self.block_size,
            self.prefill_weight,
            self.decode_weight,
            affine,
            kv_use,
            kv_high,
        )

    def routed(self, replica: int, hashes: Sequence[bytes]) -> None:
        """A request with this chain went to `replica`: assume its blocks there for a while."""
        self.indexes[replica].assume(hashes, self.assume_s)
