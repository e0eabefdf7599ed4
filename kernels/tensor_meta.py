"""What the Triton wrappers' checks and launch plans read of a tensor (shape, strides, dtype,
device), as a hashable value: each wrapper checks its inputs and works out its grid, strides and
compile-time parameters once per distinct signature (one such tuple per tensor argument), not
once per call. The signature is built of plain tuples, the cheapest to build and hash; the plan
reads them as TensorMeta."""

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


def signature(names: tuple[str, ...], tensors: tuple) -> tuple[tuple, ...]:
    """(shape, strides, dtype, device) of each tensor: TensorMeta's fields, as plain tuples.
    ValueError naming the first argument that is no tensor."""
    try:
        return tuple([(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
    except (AttributeError, TypeError):
        for name, t in zip(names, tensors, strict=True):
            meta_of(name, t)
        raise


def metas_of(sig: tuple[tuple, ...]) -> tuple[TensorMeta, ...]:
    """A signature's entries as TensorMeta."""
    return tuple(TensorMeta._make(entry) for entry in sig)
