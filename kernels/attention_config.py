"""How kernels/paged_attention.py tiles a launch, from host-known shapes only (no device sync, so
CUDA-graph safe), and the bounded set of tilings serving can reach.

Every distinct tiling is a separate Triton compilation, so the choice only ever lands on a few:
per model (dtype, head_dim, query group) the decode tiling at each split count of SPLIT_COUNTS
and the prefill tiling with 64- or 128-row query blocks. `reachable_configs` lists them, and
paged_attention.warm_up compiles them all at Worker start, so no request pays a compile.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

MAX_SPLITS = 64
# The split counts serving uses: doubling steps, so one more split never costs a compile, and at
# most 16 ranges per (sequence, KV head), enough to fill the GPU from a single decode.
SPLIT_COUNTS = (1, 2, 4, 8, 16)
PROGRAMS_PER_SM = 4


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tiling of one launch. block_m: rows per program (power of two >= 16 and >= G);
    tile_n: KV positions per tile (power of two >= 16); num_kv_splits: 1 = no split-KV (any
    1..MAX_SPLITS when forced; choose_config picks from SPLIT_COUNTS)."""

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


def num_kv_splits(
    context_len: int, num_seqs: int, num_kv_heads: int, num_sms: int, tile_n: int
) -> int:
    """Split count of a decode-only batch, always one of SPLIT_COUNTS: when its (sequence, KV
    head) programs number under PROGRAMS_PER_SM per SM, the largest count that brings them to
    about that many, and never more splits than a context_len-long context has tiles of tile_n
    positions (context_len: the block table's width in positions, the longest context it can
    hold). num_sms 0 means never split."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = min(
        triton.cdiv(PROGRAMS_PER_SM * num_sms, programs), triton.cdiv(max(1, context_len), tile_n)
    )
    return max(s for s in SPLIT_COUNTS if s <= max(1, wanted))


def decode_config(dtype: torch.dtype, head_dim: int, group: int, splits: int = 1) -> LaunchConfig:
    """The tiling of decode-only batches (every sequence one query token, or a few)."""
    group_rows = max(16, triton.next_power_of_2(group))
    if dtype == torch.float32:
        # exact fp32 dots run on FMA units, not tensor cores: small tiles, 8 warps (no spills)
        return LaunchConfig(group_rows, 32, splits, 8, 2)
    return LaunchConfig(group_rows, 64 if head_dim <= 128 else 32, splits, 4, 3)


def prefill_config(
    dtype: torch.dtype, head_dim: int, group: int, long_chunks: bool
) -> LaunchConfig:
    """The tiling of batches with prefill chunks (never split): 128-row query blocks where the
    chunks average 32 tokens or more (long_chunks) and head_dim allows, else 64."""
    if dtype == torch.float32:
        return decode_config(dtype, head_dim, group)
    block_m = 128 if long_chunks and head_dim <= 128 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    num_warps = 8 if block_m >= 128 or head_dim > 128 else 4
    return LaunchConfig(block_m, 64 if head_dim <= 128 else 32, 1, num_warps, 2)


def reachable_configs(dtype: torch.dtype, head_dim: int, group: int) -> list[LaunchConfig]:
    """Every tiling choose_config can pick for a model of this dtype, head_dim and query group
    (Hq // Hkv), each once: what warm_up compiles."""
    configs = [decode_config(dtype, head_dim, group, s) for s in SPLIT_COUNTS]
    configs += [prefill_config(dtype, head_dim, group, long) for long in (False, True)]
    return list(dict.fromkeys(configs))


def device_sms(device: torch.device) -> int:
    """The SM count of a CUDA device; 0 (never split) for any other device."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 0


def choose_config(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_sms: int | None = None,
) -> LaunchConfig:
    """config_for_shapes of these tensors; num_sms defaults to q's device's (device_sms)."""
    num_sms = device_sms(q.device) if num_sms is None else num_sms
    return config_for_shapes(q.shape, q.dtype, k_cache.shape, block_tables.shape, num_sms)


def config_for_shapes(
    q_shape: tuple[int, int, int],
    dtype: torch.dtype,
    cache_shape: tuple[int, int, int, int],
    table_shape: tuple[int, int],
    num_sms: int,
) -> LaunchConfig:
    """Pick the tiling of a launch over q [T, Hq, D], caches [num_blocks, block_size, Hkv, D] and
    block tables [B, max_blocks]. Decode-only batches (T <= B: every scheduled sequence has >= 1
    query) take the decode tiling, split as num_kv_splits says; batches with prefill chunks the
    prefill tiling."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_seqs, max_blocks = table_shape
    num_kv_heads, block_size = cache_shape[2], cache_shape[1]
    group = num_q_heads // num_kv_heads
    if num_tokens > num_seqs:
        return prefill_config(dtype, head_dim, group, num_tokens >= 32 * num_seqs)
    config = decode_config(dtype, head_dim, group)
    splits = num_kv_splits(max_blocks * block_size, num_seqs, num_kv_heads, num_sms, config.tile_n)
    return dataclasses.replace(config, num_kv_splits=splits)


@functools.lru_cache(maxsize=256)
def kernel_constexprs(
    head_dim: int, group: int, block_size: int, fp32: bool, config: LaunchConfig
) -> tuple[dict, dict | None]:
    """Compile-time parameters of the attention kernel and, when split, of the combine kernel
    (None otherwise); scripts/compile_kernels.py uses them too. Callers must not modify them."""
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
