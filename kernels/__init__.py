"""Paged attention and KV store behind one dispatch point: Triton on CUDA, torch on CPU.

Backends: `triton` (kernels/paged_attention.py, store_kv.py), `cpu` (kernels/cpu/attention.py: C
kernels over the paged cache, torch's fused CPU attention where they cannot serve; the CPU fast
path's), `reference` (kernels/reference.py: the plain torch oracle the others are tested against).
`auto`: triton on CUDA; on the CPU, cpu with the fast path's C kernels, reference without them.
The elementwise steps follow the attention backend (`elementwise_ops`): Triton's fused kernels
with triton, plain torch otherwise (the CPU fast path brings its own C ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import reference
from .elementwise import TORCH_ELEMENTWISE, ElementwiseOps


class AttentionOps(NamedTuple):
    """The two kernels the model calls; signatures are those of kernels/reference.py."""

    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


BACKENDS = ("auto", "cpu", "reference", "triton")


def attention_ops(
    device: torch.device | str, backend: str = "auto", c_kernels: bool = True
) -> AttentionOps:
    """Pick the kernels: `auto` is Triton on CUDA; on the CPU the `cpu` backend where the C
    kernels may serve (`c_kernels`: the CPU fast path is on), else the reference. An explicit
    `cpu` without `c_kernels` runs its torch paths."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu" if c_kernels else "reference"
    if backend == "cpu":
        from .cpu import attention

        if not c_kernels:
            return AttentionOps(
                "cpu", reference.store_kv, attention.CpuAttention(False).paged_attention
            )
        return AttentionOps("cpu", attention.store_kv, attention.CpuAttention().paged_attention)
    if backend == "reference":
        return AttentionOps("reference", reference.store_kv, reference.paged_attention)
    from . import paged_attention, store_kv  # Triton imports only where they are used

    return AttentionOps("triton", store_kv.store_kv, paged_attention.paged_attention)


def elementwise_ops(attention: AttentionOps) -> ElementwiseOps:
    """The elementwise bundle that goes with `attention` (what attention_ops picked): the fused
    Triton kernels with the triton backend, plain torch with the others."""
    if attention.name == "triton":
        from .elementwise_triton import TRITON_ELEMENTWISE  # Triton imports only where used

        return TRITON_ELEMENTWISE
    return TORCH_ELEMENTWISE
