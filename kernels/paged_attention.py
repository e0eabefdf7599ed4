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

Triton programs: kernels/paged_attention_triton.py (work decomposition, split-KV); their tiling:
kernels/attention_config.py. Inputs are checked, and the launch worked out, once per distinct
signature of shapes, strides, dtypes and devices (an LRU cache); a call of a known signature only
allocates its output and launches. `warm_up` compiles every variant serving can reach.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from .attention_config import (
    LaunchConfig,
    config_for_shapes,
    device_sms,
    kernel_constexprs,
    reachable_configs,
)
from .elementwise import split_qkv
from .paged_attention_triton import LOG2E
from .paged_attention_triton import combine_splits_kernel as _combine_splits_kernel
from .paged_attention_triton import paged_attention_kernel as _paged_attention_kernel
from .store_kv import store_kv
from .tensor_meta import TensorMeta, metas_of, signature

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
COMBINE_NUM_WARPS = 4
ARGUMENTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")


def _check_inputs(metas: dict[str, TensorMeta]) -> None:
    """Raise ValueError naming the argument and what was expected."""
    q, k_cache, v_cache = metas["q"], metas["k_cache"], metas["v_cache"]
    block_tables, seq_lens, query_start_loc = (
        metas["block_tables"],
        metas["seq_lens"],
        metas["query_start_loc"],
    )
    for name, t in metas.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; expected one device")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D] (3 dims), got shape {tuple(q.shape)}")
    if k_cache.ndim != 4:
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
        if metas[name].dtype != q.dtype:
            raise ValueError(f"{name} dtype {metas[name].dtype} must equal q dtype {q.dtype}")
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
        if metas[name].stride[-1] != 1:
            raise ValueError(
                f"{name} must be contiguous in its last (head_dim) dimension, "
                f"got strides {tuple(metas[name].stride)}"
            )
    if block_tables.ndim != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be a 2-D int32 tensor [B, max_blocks], got {block_tables.dtype} "
            f"of shape {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if block_tables.stride[1] != 1 and block_tables.shape[1] > 1:
        raise ValueError(f"block_tables rows must be contiguous, got {block_tables.stride}")
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


class LaunchPlan(NamedTuple):
    """Everything a call of one input signature launches with, but the tensors themselves.
    part_shape: the split partials' [T, Hq, NUM_SPLITS] (None unsplit); strides: the kernel's
    stride arguments in its order (q, k_cache, v_cache, out, block_tables)."""

    config: LaunchConfig
    consts: dict
    combine_consts: dict | None
    grid: tuple[int, int, int]
    part_shape: tuple[int, int, int] | None
    strides: tuple[int, ...]


@functools.lru_cache(maxsize=512)
def launch_plan(
    sig: tuple[tuple, ...], num_kv_splits: int | None, config: LaunchConfig | None
) -> LaunchPlan:
    """Check the inputs (the signature of ARGUMENTS, in order) and work out their launch."""
    metas = metas_of(sig)
    named = dict(zip(ARGUMENTS, metas, strict=True))
    _check_inputs(named)
    q, k_cache, v_cache, block_tables = metas[:4]
    if config is None:
        num_sms = device_sms(q.device)
        config = config_for_shapes(q.shape, q.dtype, k_cache.shape, block_tables.shape, num_sms)
    if num_kv_splits is not None:
        config = dataclasses.replace(config, num_kv_splits=num_kv_splits)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if config.block_m < group:
        raise ValueError(f"config.block_m ({config.block_m}) must be >= Hq // Hkv ({group})")
    consts, combine_consts = kernel_constexprs(
        head_dim, group, block_size, q.dtype == torch.float32, config
    )
    splits = config.num_kv_splits
    grid = (num_tokens // consts["BLOCK_Q"] + num_seqs, num_kv_heads, splits)
    out_strides = (num_q_heads * head_dim, head_dim)  # out: a fresh contiguous [T, Hq, D]
    strides = q.stride[:2] + k_cache.stride[:3] + v_cache.stride[:3] + out_strides
    strides += (block_tables.stride[0],)
    part_shape = (num_tokens, num_q_heads, splits) if splits > 1 else None
    return LaunchPlan(config, consts, combine_consts, grid, part_shape, strides)


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
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    plan = launch_plan(signature(ARGUMENTS, tensors), num_kv_splits, config)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return out
    if plan.part_shape is not None:
        part_m = torch.empty(plan.part_shape, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            plan.part_shape + (plan.combine_consts["D_PAD"],),
            dtype=torch.float32,
            device=q.device,
        )
    else:
        part_acc = part_m = part_l = out  # unused by the NUM_SPLITS == 1 specialisation
    _paged_attention_kernel[plan.grid](
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
        block_tables.shape[0],
        q.shape[1],
        *plan.strides,
        **plan.consts,
        num_warps=plan.config.num_warps,
        num_stages=plan.config.num_stages,
    )
    if plan.part_shape is not None:
        _combine_splits_kernel[plan.part_shape[:2]](
            out,
            part_acc,
            part_m,
            part_l,
            q.shape[1],
            *plan.strides[8:10],
            **plan.combine_consts,
            num_warps=COMBINE_NUM_WARPS,
        )
    return out


def warm_up(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> int:
    """Launch every kernel variant serving can reach for a model of these shapes, on a tiny
    dummy cache, so Triton compiles them now and no request waits for a compile: the attention
    kernel in each tiling of attention_config.reachable_configs, the combine kernel of each
    split count above 1, and the KV store. The inputs are laid out as the model's (q and k
    contiguous, v a view of a fused qkv row, int64 slots), since Triton also compiles apart
    what differs in stride divisibility. Returns the number of variants launched."""
    device = torch.device(device)
    group = num_q_heads // num_kv_heads
    shape = (4, block_size, num_kv_heads, head_dim)  # two sequences of two blocks each
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    num_tokens = 2  # one decode query per sequence
    qkv = torch.zeros(
        (num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim), dtype=dtype, device=device
    )
    _, k, v = split_qkv(qkv, num_q_heads, num_kv_heads)
    slots = torch.tensor([block_size, 3 * block_size], dtype=torch.int64, device=device)
    store_kv(k.contiguous(), v, k_cache, v_cache, slots)
    q = torch.zeros((num_tokens, num_q_heads, head_dim), dtype=dtype, device=device)
    tables = torch.arange(4, dtype=torch.int32, device=device).view(2, 2)
    seq_lens = torch.tensor([block_size + 1, 2 * block_size], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    variants = 1
    for config in reachable_configs(dtype, head_dim, group):
        paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, 1.0, config=config)
        variants += 2 if config.num_kv_splits > 1 else 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a launch that fails does so here, at start
    return variants


__all__ = ["paged_attention", "warm_up"]
