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

Triton programs: kernels/paged_attention_triton.py (work decomposition, split-KV).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from .paged_attention_triton import LOG2E
from .paged_attention_triton import combine_splits_kernel as _combine_splits_kernel
from .paged_attention_triton import paged_attention_kernel as _paged_attention_kernel

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
