"""Prefix-cache block hashes: blake2b-128 chained over full blocks of token ids, rooted in the
request's cache salt.

    hash(block 0) = blake2b(root || ids of block 0),   root = chain_root(cache_salt)
    hash(block i) = blake2b(hash(block i - 1) || ids of block i)

The ids are packed as little-endian int64, whatever the host: the hashes leave the BlockManager
in its KV events (messages/kv_events.py), and a gateway on another host computes the same chain
for a prompt to find which replica holds it (gateway/kv_routing.py); this module is the one place
both take the function from. The parent is always 16 bytes, so the
input splits one way only. Why not Python's hash() of tuples: it is 64-bit and its integer hash
is public arithmetic, so a tenant could craft blocks that collide with another tenant's prompt and
learn from the timing whether it was cached; against a 128-bit cryptographic hash even a random
collision takes about 2**64 tries. The pool still compares the tokens of every hit.

Requests with different salts start different chains, so they never share a block, even for the
same tokens; requests without a salt share the all-zero root (a salt's root is a blake2b with its
own `person`, so no salt can yield it).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence

DIGEST_SIZE = 16
NO_SALT = bytes(DIGEST_SIZE)  # the root of every chain without a cache salt
_SALT_PERSON = b"actorserve-salt"  # blake2b personalization: salt roots apart from block hashes
_ID_BYTES = array("q").itemsize  # 8


def chain_root(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block."""
    if cache_salt is None:
        return NO_SALT
    return hashlib.blake2b(
        cache_salt.encode(), digest_size=DIGEST_SIZE, person=_SALT_PERSON
    ).digest()


def _packed(token_ids: Sequence[int]) -> bytes:
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block whose tokens are `token_ids`, after the block hashed `parent`."""
    return hashlib.blake2b(parent + _packed(token_ids), digest_size=DIGEST_SIZE).digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int], block_size: int) -> Iterator[bytes]:
    """block_hash of each full block of `token_ids` in turn, chained from `parent`; lazily (a
    lookup stops at its first miss), the ids packed once (a quarter of the cost per block)."""
    packed = _packed(token_ids)
    step = block_size * _ID_BYTES
    for offset in range(0, len(packed) - step + 1, step):
        parent = hashlib.blake2b(
            parent + packed[offset : offset + step], digest_size=DIGEST_SIZE
        ).digest()
        yield parent
