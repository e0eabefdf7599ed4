"""Triton varlen paged attention: prefill chunks and decodes in one launch, GQA, split-KV.

Shapes (T = tokens in the step, B = sequences, D = head_dim, G = Hq // Hkv):
    q                 [T, Hq, D]            fp16 / bf16 / fp32, last dim contiguous
    k_cache, v_cache  [num_blocks, block_size, Hkv, D]   same dtype as q, last dim contiguous
    block_tables      [B, max_blocks] int32 (entries past a sequence's blocks are never read)
    seq_lens          [B] int32: cache length of each sequence *including* this step's tokens
    query_start_loc   [B+1] int32: sequence b's queries are
                      q[query_start_loc[b] : query_start_loc[b+1]]
    out               [T, Hq, D]            same dtype as q

Query i of sequence b (qlen_b queries) sits at position seq_lens[b] - qlen_b + i and attends to
cache positions 0..that position. Semantics are those of kernels/reference.py.

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

import dataclasses
import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
COMBINE_NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tiling of one launch. block_m: rows per program (power of two >= 16 and >= G);
    tile_n: KV positions per tile (power of two >= 16); num_kv_splits: 1 = no split-KV."""

    block_m: int = 16
    tile_n: int = 64
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two >= 16, got {value}")
        if not 1 <= self.num_kv_splits <= MAX_SPLITS:
            raise ValueError(
                f"LaunchConfig.num_kv_splits must be in 1..{MAX_SPLITS}, got {self.num_kv_splits}"
            )


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
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
def _attend_tile(
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


@triton.jit
def _paged_attention_kernel(
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

    seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
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
        acc, l_i, m_i = _attend_tile(
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
        acc, l_i, m_i = _attend_tile(
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
def _combine_splits_kernel(
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


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_sms: int | None = None,
) -> LaunchConfig:
    """Pick tiling from host-known shapes only (no device sync, so CUDA-graph safe).

    Decode-only batches (T <= B: every scheduled sequence has >= 1 query) take 16-row query
    blocks; when their (sequence, KV head) programs number under 4 per SM they split the KV range
    so that about 4 programs per SM run (never more splits than the block table has tiles).
    Batches with prefill chunks take 64- or 128-row query blocks and no split. num_sms defaults
    to the CUDA device's SM count and to 0 (never split) elsewhere."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, max_blocks = block_tables.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group_rows = max(16, triton.next_power_of_2(num_q_heads // num_kv_heads))
    decode_only = num_tokens <= num_seqs
    if q.dtype == torch.float32:
        # exact fp32 dots run on FMA units, not tensor cores: small tiles, 8 warps (no spills)
        block_m, tile_n, num_warps, num_stages = group_rows, 32, 8, 2
    elif decode_only:
        block_m, tile_n, num_warps, num_stages = group_rows, 64 if head_dim <= 128 else 32, 4, 3
    else:
        block_m = 128 if num_tokens >= 32 * num_seqs and head_dim <= 128 else 64
        block_m = max(block_m, group_rows)
        tile_n = 64 if head_dim <= 128 else 32
        num_warps = 8 if block_m >= 128 or head_dim > 128 else 4
        num_stages = 2
    splits = 1
    if decode_only:
        if num_sms is None:
            num_sms = _num_sms(q.device.index or 0) if q.is_cuda else 0
        programs = max(1, num_seqs * num_kv_heads)
        target = 4 * num_sms
        max_tiles = triton.cdiv(max_blocks * block_size, tile_n)
        if programs < target:
            splits = max(1, min(MAX_SPLITS, triton.cdiv(target, programs), max_tiles))
    return LaunchConfig(block_m, tile_n, splits, num_warps, num_stages)


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    """Raise ValueError naming the argument and what was expected."""
    tensors = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; expected one device")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D] (3 dims), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, Hkv, D] (4 dims), got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name in ("k_cache", "v_cache"):
        if tensors[name].dtype != q.dtype:
            raise ValueError(f"{name} dtype {tensors[name].dtype} must equal q dtype {q.dtype}")
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim {cache_head_dim} must equal q head_dim {head_dim}")
    if not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 16..{MAX_HEAD_DIM}, got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of k_cache heads ({num_kv_heads})"
        )
    if block_size < 1:
        raise ValueError(f"k_cache block_size must be >= 1, got {block_size}")
    for name in ("q", "k_cache", "v_cache"):
        if tensors[name].stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last (head_dim) dimension, "
                f"got strides {tuple(tensors[name].stride())}"
            )
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be a 2-D int32 tensor [B, max_blocks], got {block_tables.dtype} "
            f"of shape {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError(f"block_tables rows must be contiguous, got {block_tables.stride()}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(
            f"seq_lens must be int32 of shape [B]=({num_seqs},), got {seq_lens.dtype} "
            f"of shape {tuple(seq_lens.shape)}"
        )
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be int32 of shape [B+1]=({num_seqs + 1},), got "
            f"{query_start_loc.dtype} of shape {tuple(query_start_loc.shape)}"
        )


def kernel_constexprs(
    head_dim: int, group: int, block_size: int, fp32: bool, config: LaunchConfig
) -> tuple[dict, dict | None]:
    """Compile-time parameters of `_paged_attention_kernel` and, when split, of
    `_combine_splits_kernel` (None otherwise); scripts/bench_kernels.py --compile-only uses them
    too."""
    d_pad = triton.next_power_of_2(head_dim)
    splits = config.num_kv_splits
    attention = dict(
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        GROUP=group,
        BLOCK_M=config.block_m,
        BLOCK_Q=config.block_m // group,
        TILE_N=config.tile_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=splits,
        IEEE_FP32=fp32,
    )
    if splits == 1:
        return attention, None
    combine = dict(
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        NUM_SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
    )
    return attention, combine


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    num_kv_splits: int | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Attention of q over the paged caches -> out [T, Hq, D] (q's dtype, contiguous).

    num_kv_splits forces split-KV (>1) or forbids it (1); config overrides the whole tiling.
    Values are not checked on the host (that would sync): the caller guarantees
    1 <= seq_lens[b], query_start_loc nondecreasing from 0 to T, qlen_b <= seq_lens[b], and
    block table entries in range for the first cdiv(seq_lens[b], block_size) blocks."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if config is None:
        config = choose_config(q, k_cache, block_tables)
    if num_kv_splits is not None:
        config = dataclasses.replace(config, num_kv_splits=num_kv_splits)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if config.block_m < group:
        raise ValueError(f"config.block_m ({config.block_m}) must be >= Hq // Hkv ({group})")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    d_pad = triton.next_power_of_2(head_dim)
    consts, combine_consts = kernel_constexprs(
        head_dim, group, block_size, q.dtype == torch.float32, config
    )
    splits = config.num_kv_splits
    if splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_q_heads, splits, d_pad), dtype=torch.float32, device=q.device
        )
        part_m = torch.empty(
            (num_tokens, num_q_heads, splits), dtype=torch.float32, device=q.device
        )
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused by the NUM_SPLITS == 1 specialisation
    grid = (num_tokens // consts["BLOCK_Q"] + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_m,
        part_l,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale) * LOG2E,
        num_seqs,
        num_q_heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        **consts,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            num_q_heads,
            out.stride(0),
            out.stride(1),
            **combine_consts,
            num_warps=COMBINE_NUM_WARPS,
        )
    return out


__all__ = ["LaunchConfig", "choose_config", "paged_attention"]
