"""What the Triton wrappers' checks and launch plans read of a tensor (shape, strides, dtype,
device), as a hashable value: each wrapper checks its inputs and works out its grid, strides and
compile-time parameters once per distinct tuple of these, not once per call."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def ndim(self) -> int:
        return len(self.shape)


def meta_of(name: str, t: object) -> TensorMeta:
    """The tensor's TensorMeta; ValueError naming the argument when it is no tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return TensorMeta(t.shape, t.stride(), t.dtype, t.device)
