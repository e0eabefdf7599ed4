"""Paged attention and KV store behind one dispatch point: Triton on CUDA, torch on CPU.

Backends: `triton` (kernels/paged_attention.py, store_kv.py), `cpu` (kernels/cpu.py: a C decode
kernel and torch's fused CPU attention over the paged cache, the serving path on CPU), `reference`
(kernels/reference.py: the plain torch oracle the others are tested against). `auto`: triton on
CUDA, cpu elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import reference


class AttentionOps(NamedTuple):
    """The two kernels the model calls; signatures are those of kernels/reference.py."""

    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


BACKENDS = ("auto", "cpu", "reference", "triton")


def attention_ops(device: torch.device | str, backend: str = "auto") -> AttentionOps:
    """Pick the kernels: `auto` is Triton on CUDA and the fused torch path (`cpu`) elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu"
    if backend == "cpu":
        from . import cpu

        return AttentionOps("cpu", cpu.store_kv, cpu.CpuAttention().paged_attention)
    if backend == "reference":
        return AttentionOps("reference", reference.store_kv, reference.paged_attention)
    from . import paged_attention, store_kv  # Triton imports only where they are used

    return AttentionOps("triton", store_kv.store_kv, paged_attention.paged_attention)
