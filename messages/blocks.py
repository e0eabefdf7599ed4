"""Scheduler <-> BlockManager: one round trip per step."""

from __future__ import annotations

import msgspec


class BlockNeed(msgspec.Struct, array_like=True, gc=False):
    """Room for `num_tokens` tokens in total (computed + this step's) for one request."""

    request_id: str
    num_tokens: int
    is_new: bool  # waiting -> running: may be denied, never preempts others


class AllocateStep(msgspec.Struct, tag=True, array_like=True, gc=False):
    """`needs` in priority order. When blocks run out for a running request, the BlockManager
    preempts from the tail of this list (frees the last running request's blocks) until it fits,
    the request itself being the last resort. A new request that does not fit is denied, and so
    are all new requests after it (FCFS: nobody jumps the queue).
    """

    epoch: int
    step_id: int
    needs: list[BlockNeed]


class Grant(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    new_block_ids: list[int]


class Allocation(msgspec.Struct, tag=True, array_like=True, gc=False):
    epoch: int
    step_id: int
    granted: list[Grant]
    preempted: list[str]
    denied: list[str]


class FreeBlocks(msgspec.Struct, tag=True, array_like=True):
    epoch: int
    request_ids: list[str]
