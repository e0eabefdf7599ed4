"""Paged attention and KV store behind one dispatch point: Triton on CUDA, torch on CPU."""

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


BACKENDS = ("auto", "reference", "triton")


def attention_ops(device: torch.device | str, backend: str = "auto") -> AttentionOps:
    """Pick the kernels: `auto` is Triton on CUDA and the torch reference elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "reference"
    if backend == "reference":
        return AttentionOps("reference", reference.store_kv, reference.paged_attention)
    from . import paged_attention, store_kv  # Triton imports only where they are used

    return AttentionOps("triton", store_kv.store_kv, paged_attention.paged_attention)
