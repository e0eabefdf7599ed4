"""The Triton programs behind kernels/paged_attention.py (which checks inputs and launches).

Work decomposition. A program owns one KV head and a "query block" of BLOCK_M rows: BLOCK_Q
consecutive query tokens of one sequence times the G query heads that share the KV head (row r is
token r // G, head r % G), so every K/V tile is loaded once for the whole group and tl.dot sees
M = BLOCK_M >= 16 even for a single decode token. Query blocks are numbered without a host sync:
sequence b owns block ids [query_start_loc[b] // BLOCK_Q + b, query_start_loc[b+1] // BLOCK_Q + b],
an upper bound of T // BLOCK_Q + B blocks in all; spare ones exit at once. Each program walks its
sequence's KV positions in tiles of TILE_N (independent of block_size), resolving block ids through
the block table per position, with an fp32 online softmax in the exp2 domain. Tiles that lie wholly
at or before the block's first query position need no causal mask and take an unmasked loop.

Split-KV (flash decoding): with NUM_SPLITS > 1 a third grid axis cuts each query block's tiles into
NUM_SPLITS contiguous ranges; every (row, split) writes an unnormalised accumulator and its running
max / sum (log2 domain, empty ranges write -inf / 0), and `_combine_splits_kernel` merges them. The
wrapper picks it for decode-only batches with too few (sequence, KV head) programs to fill the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= q_block (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    tile,
    seq_len,
    qk_scale,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    offs_d,
    d_ok,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAD_D: tl.constexpr,
    MASKED: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """One KV tile of the online softmax. acc [BLOCK_M, D_PAD] fp32, l_i / m_i [BLOCK_M] fp32
    (m_i in log2 units). MASKED=False promises every tile position is < seq_len and <= every
    row's query position, so loads and scores go unmasked."""
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    n_ok = offs_n < seq_len
    if MASKED:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
    else:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
    block_ids = block_ids.to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_ptrs = (
        k_cache_ptr
        + block_ids[None, :] * stride_kb
        + in_block[None, :] * stride_kt
        + kv_head * stride_kh
        + offs_d[:, None]
    )  # [D_PAD, TILE_N]: K transposed
    v_ptrs = (
        v_cache_ptr
        + block_ids[:, None] * stride_vb
        + in_block[:, None] * stride_vt
        + kv_head * stride_vh
        + offs_d[None, :]
    )  # [TILE_N, D_PAD]
    if MASKED:
        if PAD_D:
            k = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        if PAD_D:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)

    if IEEE_FP32:  # fp32 inputs: exact fp32 products instead of the TF32 default
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale  # [BLOCK_M, TILE_N], log2 units
    if MASKED:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE_FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


# Triton compiles apart integer arguments equal to 1 or divisible by 16; the batch's sequence
# count and block table width change every step, so they are not specialised on.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    num_seqs,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """Grid (T // BLOCK_Q + B, Hkv, NUM_SPLITS). See the module docstring for the decomposition.
    NUM_SPLITS == 1 writes out [T, Hq, D]; otherwise the fp32 partials
    part_acc [T, Hq, NUM_SPLITS, D_PAD], part_m / part_l [T, Hq, NUM_SPLITS]."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + offs_m // GROUP  # query index inside the sequence's chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = prefix_len + q_idx  # absolute position of each row's query
    token = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Tiles this program visits: up to the block's last query; those wholly at or before its
    # first query need no mask. Split-KV takes a contiguous share of them.
    last_pos = prefix_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(last_pos + 1, TILE_N)
    num_full_tiles = (prefix_len + local_block * BLOCK_Q + 1) // TILE_N
    if NUM_SPLITS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = tl.minimum(split * per_split, num_tiles)
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    full_hi = tl.minimum(tl.maximum(num_full_tiles, tile_lo), tile_hi)

    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for tile in range(tile_lo, full_hi):
        acc, l_i, m_i = attend_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            tile,
            seq_len,
            qk_scale,
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            kv_head,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            offs_d,
            d_ok,
            TILE_N,
            BLOCK_SIZE,
            HEAD_DIM != D_PAD,
            False,
            IEEE_FP32,
        )
    for tile in range(full_hi, tile_hi):
        acc, l_i, m_i = attend_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            tile,
            seq_len,
            qk_scale,
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            kv_head,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            offs_d,
            d_ok,
            TILE_N,
            BLOCK_SIZE,
            HEAD_DIM != D_PAD,
            True,
            IEEE_FP32,
        )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (token * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M] row of partials
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def combine_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Grid (T, Hq): out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < NUM_SPLITS
    base = (token * num_q_heads + head) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.math.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(weight * l_s, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
