"""Paged attention for serving on CPU: the reference's semantics (kernels/reference.py), built for
speed from torch's fused CPU attention (`scaled_dot_product_attention`, flash-style, GQA without
copying K/V per query head).

What costs on CPU is memory traffic, not FLOPs: every decode reads its whole context. So:
- the step's layout (which rows decode, their blocks, masks) is worked out once per step and
  reused by every layer (the layers pass the same metadata; it is compared by content, which
  costs microseconds);
- decodes are sorted by context length and cut into groups, each padded only to its own longest
  context, so short sequences do not pay for the longest one;
- K/V are gathered block by block (one index_select per group) and handed to the attention as
  strided views: no repeat per query head, no transposed copy.
Prefill chunks run one sequence at a time, causal inside the chunk, full over the cached prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .reference import store_kv

__all__ = ["paged_attention", "store_kv"]

DECODE_GROUP = 16  # decode rows per attention call (sorted by length, padded within the group)


class _DecodeGroup(NamedTuple):
    token_rows: torch.Tensor  # [R] rows of q / out
    blocks: torch.Tensor  # [R * nb] block ids (past a row's own blocks: block 0, masked)
    num_blocks: int  # nb
    mask: torch.Tensor | None  # [R, 1, 1, nb * bs] True = attend; None when nothing is padded


class _Prefill(NamedTuple):
    start: int
    end: int
    blocks: torch.Tensor  # the sequence's blocks, in order
    context: int  # tokens in the cache for it, this chunk included
    mask: torch.Tensor | None  # [n, context]; None = plain causal (no cached prefix)


class _Layout(NamedTuple):
    decode: list[_DecodeGroup]
    prefill: list[_Prefill]


_cache: tuple[int, tuple[torch.Tensor, ...], _Layout] | None = None  # the last step's layout


def _same(key: tuple[torch.Tensor, ...], tensors: tuple[torch.Tensor, ...]) -> bool:
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(key, tensors))


def _layout(block_tables, seq_lens, query_start_loc, block_size: int) -> _Layout:
    global _cache
    tensors = (block_tables, seq_lens, query_start_loc)
    if _cache is not None and _cache[0] == block_size and _same(_cache[1], tensors):
        return _cache[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    device = block_tables.device
    decode_rows = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    decode_rows.sort(key=lambda b: lens[b])
    groups = []
    for i in range(0, len(decode_rows), DECODE_GROUP):
        rows = decode_rows[i : i + DECODE_GROUP]
        ctx = torch.tensor([lens[b] for b in rows], device=device)
        nb = -(-lens[rows[-1]] // block_size)  # the longest of the group (sorted)
        tables = block_tables[torch.tensor(rows, device=device), :nb].long()
        owned = torch.arange(nb, device=device) * block_size < ctx.unsqueeze(1)
        tables = torch.where(owned, tables, torch.zeros_like(tables))
        mask = None
        if lens[rows[0]] != nb * block_size:  # some row has padding to hide
            positions = torch.arange(nb * block_size, device=device)
            mask = (positions < ctx.unsqueeze(1)).view(len(rows), 1, 1, -1)
        token_rows = torch.tensor([starts[b] for b in rows], device=device)
        groups.append(_DecodeGroup(token_rows, tables.reshape(-1), nb, mask))
    prefills = []
    for b, context in enumerate(lens):
        n = starts[b + 1] - starts[b]
        if n <= 1:
            continue
        nb = -(-context // block_size)
        mask = None
        if n != context:
            q_pos = torch.arange(context - n, context, device=device).unsqueeze(1)
            mask = torch.arange(context, device=device).unsqueeze(0) <= q_pos
        blocks = block_tables[b, :nb].long()
        prefills.append(_Prefill(starts[b], starts[b + 1], blocks, context, mask))
    layout = _Layout(groups, prefills)
    _cache = (block_size, tuple(t.clone() for t in tensors), layout)
    return layout


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as kernels.reference.paged_attention."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    gqa = num_heads != num_kv_heads
    layout = _layout(block_tables, seq_lens, query_start_loc, block_size)
    out = torch.empty_like(q)
    for g in layout.decode:
        rows = g.token_rows.numel()
        length = g.num_blocks * block_size
        # [R * nb, bs, Hkv, D] -> [R, L, Hkv, D] -> strided view [R, Hkv, L, D]
        k = k_cache.index_select(0, g.blocks).view(rows, length, num_kv_heads, head_dim)
        v = v_cache.index_select(0, g.blocks).view(rows, length, num_kv_heads, head_dim)
        qd = q.index_select(0, g.token_rows).unsqueeze(2)  # [R, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qd,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=g.mask,
            scale=scale,
            enable_gqa=gqa,
        )
        out.index_copy_(0, g.token_rows, o.squeeze(2))
    for p in layout.prefill:
        k = k_cache.index_select(0, p.blocks).view(1, -1, num_kv_heads, head_dim)
        v = v_cache.index_select(0, p.blocks).view(1, -1, num_kv_heads, head_dim)
        k, v = k[:, : p.context].transpose(1, 2), v[:, : p.context].transpose(1, 2)
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        o = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
        )
        out[p.start : p.end] = o[0].transpose(0, 1)
    return out
