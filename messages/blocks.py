"""Scheduler <-> BlockManager: one round trip per step."""

from __future__ import annotations

import msgspec


class BlockNeed(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Room for `num_computed + num_new_tokens` tokens for one request.

    `token_ids`: the request's tokens the BlockManager has not been told yet (all of them for a
    new request; the newly sampled ones for a running one), for prefix-cache hashing.
    A new request's `num_computed` is 0 unless it is coming back from swap; the BlockManager may
    raise it (prefix cache hit) and shrink `num_new_tokens` to what is left of the prompt.
    `no_prefix_hits`: a new request that must compute its whole prompt (it wants prompt logprobs,
    which cached tokens would lack); its full blocks are still registered for others.
    `lookahead` (a running request): room for this many tokens more if blocks are to spare, so
    that the next steps need no round trip; never preempts anyone, nor takes the watermark.
    """

    request_id: str
    num_computed: int
    num_new_tokens: int
    is_new: bool  # waiting -> running: may be denied, never preempts others
    token_ids: list[int]
    no_prefix_hits: bool = False
    fork_of: str | None = None  # share this running request's blocks (copy-on-write)
    lookahead: int = 0
    # A new request's SamplingParams.cache_salt: its blocks hash in a chain of that salt's, so
    # requests of different salts never share a block (last: array_like fields only append).
    cache_salt: str | None = None


class AllocateStep(msgspec.Struct, tag=True, array_like=True, gc=False):
    """`needs` in priority order. When blocks run out for a running request, the BlockManager
    preempts from the tail of this list (frees, or swaps out, the last running request's blocks)
    until it fits, the request itself being the last resort. A new request that does not fit is
    denied, and so are all new requests after it (nobody jumps the queue).
    New requests also share `new_token_budget`, spent on what is left of each prompt *after* its
    prefix-cache hit (the Scheduler cannot know the hits): a request the budget cannot reach is
    denied too, and one it reaches in part is prefilled in a chunk.
    `overlapped`: planned while the previous step still runs, so no request may lose its blocks:
    when the running requests' blocks do not all fit, nothing is allocated and every need is
    denied (the Scheduler then plans again, the normal way, once that step is done).
    """

    epoch: int
    step_id: int
    needs: list[BlockNeed]
    new_token_budget: int
    overlapped: bool = False


class Grant(msgspec.Struct, array_like=True, gc=False):
    """For a running request `block_ids` are its new blocks; for a new one its whole table."""

    request_id: str
    block_ids: list[int]
    num_computed: int
    num_new_tokens: int


class Allocation(msgspec.Struct, tag=True, array_like=True, gc=False, omit_defaults=True):
    epoch: int
    step_id: int
    granted: list[Grant]
    preempted: list[str]  # lost their blocks: recompute when re-admitted
    denied: list[str]
    swapped: list[str] = []  # KV moved to CPU: resume where they were when re-admitted
    swap_out: list[tuple[int, int]] = []  # (gpu block, cpu block) to copy before the step
    swap_in: list[tuple[int, int]] = []  # (cpu block, gpu block) to copy after swap_out
    copies: list[tuple[int, int]] = []  # (src, dst) device blocks: copy-on-write of forks


class FreeBlocks(msgspec.Struct, tag=True, array_like=True):
    epoch: int
    request_ids: list[str]
