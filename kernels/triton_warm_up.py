"""One call that compiles every Triton kernel variant a model serves with, at Worker start: the
paged attention in each reachable tiling and the KV store (paged_attention.warm_up), and the fused
elementwise kernels (elementwise_triton.warm_up). Without it the first requests of each kind wait
for Triton's compiler."""

from __future__ import annotations

from typing import Protocol

import torch

from . import elementwise_triton, paged_attention


class ModelShape(Protocol):
    """What the warm-up reads of a model's config (actors/model_config.ModelConfig)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool


def warm_up_triton(
    shape: ModelShape, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> int:
    """Compile every Triton kernel variant serving `shape` in `dtype` can launch; returns how
    many variants were launched."""
    attention = paged_attention.warm_up(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, block_size, dtype, device
    )
    elementwise = elementwise_triton.warm_up(
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.qk_norm,
        dtype,
        device,
    )
    return attention + elementwise
