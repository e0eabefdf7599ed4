"""Triton KV store: write this step's K/V rows into the paged caches by slot.

Shapes (T = tokens in the step, D = head_dim):
    k, v              [T, Hkv, D]   any float dtype, last dim contiguous (cast to the cache dtype)
    k_cache, v_cache  [num_blocks, block_size, Hkv, D]   fp16 / bf16 / fp32, last dim contiguous
    slot_mapping      [T] int32 or int64: flat slot block * block_size + offset, -1 = skip

Token t lands in k_cache[slot // block_size, slot % block_size] (all heads). Slots outside
0..num_blocks * block_size - 1 (in particular -1) are skipped, so no write ever leaves the cache.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .tensor_meta import TensorMeta, metas_of, signature

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ARGUMENTS = ("k", "v", "k_cache", "v_cache", "slot_mapping")


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Grid (T,): program t copies k[t], v[t] ([Hkv, D] each) into slot slot_mapping[t]."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    k_dst = (
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kct
        + offs_h[:, None] * stride_kch
        + offs_d[None, :]
    )
    v_dst = (
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vct
        + offs_h[:, None] * stride_vch
        + offs_d[None, :]
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(k, v, k_cache, v_cache, slot_mapping: TensorMeta) -> None:
    """Raise ValueError naming the argument and what was expected."""
    tensors = dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    for name, t in tensors.items():
        if t.device != k_cache.device:
            raise ValueError(
                f"{name} is on {t.device} but k_cache is on {k_cache.device}; expected one device"
            )
    if k_cache.ndim != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, Hkv, D] (4 dims), got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        )
    for name in ("k_cache", "v_cache"):
        if tensors[name].dtype not in CACHE_DTYPES:
            raise ValueError(
                f"{name} dtype must be float16, bfloat16 or float32, got {tensors[name].dtype}"
            )
    _, _, num_kv_heads, head_dim = k_cache.shape
    if k.ndim != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k must be [T, Hkv, D] = [T, {num_kv_heads}, {head_dim}] to match k_cache, "
            f"got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    for name in ("k", "v"):
        if not tensors[name].dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor, got {tensors[name].dtype}")
    for name in ("k", "v", "k_cache", "v_cache"):
        if tensors[name].stride[-1] != 1:
            raise ValueError(
                f"{name} must be contiguous in its last (head_dim) dimension, "
                f"got strides {tuple(tensors[name].stride)}"
            )
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (
        k.shape[0],
    ):
        raise ValueError(
            f"slot_mapping must be int32 or int64 of shape [T]=({k.shape[0]},), got "
            f"{slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}"
        )


class StorePlan(NamedTuple):
    """A call's launch but for the tensors: its scalar arguments (slot count, then the strides
    of k, v, k_cache, v_cache) and compile-time parameters."""

    scalars: tuple[int, ...]
    consts: dict


@functools.lru_cache(maxsize=256)
def store_plan(sig: tuple[tuple, ...]) -> StorePlan:
    """Check the inputs (the signature of ARGUMENTS, in order) and work out the launch."""
    metas = metas_of(sig)
    _check_inputs(*metas)
    k, v, k_cache, v_cache, _ = metas
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    scalars = (num_blocks * block_size,) + k.stride[:2] + v.stride[:2]
    scalars += k_cache.stride[:3] + v_cache.stride[:3]
    consts = dict(
        NUM_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
    return StorePlan(scalars, consts)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into the caches at flat slots (block * bs + offset); -1 skips.
    Inputs are checked, and the launch worked out, once per signature (store_plan)."""
    plan = store_plan(signature(ARGUMENTS, (k, v, k_cache, v_cache, slot_mapping)))
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        *plan.scalars,
        **plan.consts,
        num_warps=4,
    )


__all__ = ["store_kv"]
