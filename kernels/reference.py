"""Pure-torch paged attention and KV store: the CPU path and the test oracle for the Triton kernels.

Shapes (T = tokens in the step, B = sequences, D = head_dim):
    q                 [T, Hq, D]
    k_cache, v_cache  [num_blocks, block_size, Hkv, D]
    block_tables      [B, max_blocks] int32 (entries past a sequence's blocks are ignored)
    seq_lens          [B] int32: tokens in the cache for each sequence *including* this step's
    query_start_loc   [B+1] int32: sequence b's queries are
                      q[query_start_loc[b] : query_start_loc[b+1]]

Query i of sequence b (qlen_b queries) sits at position seq_lens[b] - qlen_b + i and attends to
cache positions 0..that position (causal inside the chunk, full over the cached prefix).
Decodes (qlen 1) are batched in one padded matmul; longer query chunks run one sequence at a time
(a loop per sequence, never per token or per block).
"""

from __future__ import annotations

import torch


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into the caches at flat slots (block * bs + offset); -1 skips."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] + one table row -> [length, H, D] (one sequence's keys in order)."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [B, Hq, Q, D], k/v [B, Hkv, L, D], mask [B, 1, Q, L] (True = attend) -> [B, Hq, Q, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    qlens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    decode = [b for b, n in enumerate(qlens) if n == 1]
    if decode:
        _decode_batch(q, k_cache, v_cache, block_tables, lens, starts, decode, scale, out)
    for b, n in enumerate(qlens):
        if n <= 1:
            continue
        ctx = lens[b]
        k = _gather_context(k_cache, block_tables[b], ctx).transpose(0, 1).unsqueeze(0)
        v = _gather_context(v_cache, block_tables[b], ctx).transpose(0, 1).unsqueeze(0)
        qb = q[starts[b] : starts[b + 1]].transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
        mask = (k_pos <= q_pos).view(1, 1, n, ctx)
        out[starts[b] : starts[b + 1]] = _attend(qb, k, v, mask, scale)[0].transpose(0, 1)
    return out


def _decode_batch(q, k_cache, v_cache, block_tables, lens, starts, rows, scale, out) -> None:
    """All single-query sequences at once: gather their blocks padded to the longest context."""
    block_size = k_cache.shape[1]
    idx = torch.tensor(rows, device=q.device)
    ctx = torch.tensor([lens[b] for b in rows], device=q.device)
    max_ctx = int(ctx.max())
    num_blocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables.index_select(0, idx)[:, :num_blocks].long()
    # Entries past a sequence's own blocks may hold anything (-1, stale ids): point them at block 0,
    # whose keys the length mask hides anyway.
    owned = torch.arange(num_blocks, device=q.device) * block_size < ctx.unsqueeze(1)
    tables = torch.where(owned, tables, torch.zeros_like(tables))
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # [R, nb, bs, Hkv, D] -> [R, Hkv, nb*bs, D]
    k = k_cache[tables].reshape(len(rows), -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[tables].reshape(len(rows), -1, num_kv_heads, head_dim).transpose(1, 2)
    token_rows = torch.tensor([starts[b] for b in rows], device=q.device)
    qd = q.index_select(0, token_rows).unsqueeze(2)  # [R, Hq, 1, D]
    k_pos = torch.arange(num_blocks * block_size, device=q.device)
    mask = (k_pos.unsqueeze(0) < ctx.unsqueeze(1)).view(len(rows), 1, 1, -1)
    out.index_copy_(0, token_rows, _attend(qd, k, v, mask, scale).squeeze(2))
