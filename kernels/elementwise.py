"""The decoder's elementwise steps in plain torch, the same math as Hugging Face's Llama modules,
behind `ElementwiseOps`: the model calls them through the bundle it was built with, so a backend
can give fused versions (kernels/cpu/elementwise.py) without the model knowing."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class ElementwiseOps(NamedTuple):
    """The three elementwise steps the model calls; signatures are those of the functions below."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    rope: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LlamaRMSNorm of s = x + residual (of x alone when residual is None) -> (normed, s or None).
    x [..., D], residual the same shape or None, weight [D]."""
    if residual is not None:
        x = residual = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate columns, then up) -> silu(gate) * up [N, I], as LlamaMLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, H, D] by tables cos, sin [T, 1, D] laid out as [c, c] and
    [-s, s]: x * cos + [x2, x1] * sin, with x = [x1, x2] (halves), each product and the sum
    rounded on their own: Hugging Face's q * cos + rotate_half(q) * sin, to the bit."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


TORCH_ELEMENTWISE = ElementwiseOps("torch", rms_norm, rope, silu_mul)
