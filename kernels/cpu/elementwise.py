"""The decoder's elementwise steps fused in C (csrc/cpu_elementwise.c) for fp32 tensors on the
CPU, where torch makes one pass over the rows per op; kernels/elementwise.py's torch versions
serve every input the C does not take. Same results as those, to the bit for rope."""

from __future__ import annotations

import torch

from .. import elementwise
from ..elementwise import ElementwiseOps
from . import bindings


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.elementwise.rms_norm; the C path takes x [N, D] with contiguous rows and a
    contiguous residual of its shape."""
    if residual is None or (residual.is_contiguous() and residual.shape == x.shape):
        both = (x,) if residual is None else (x, residual)
        lib = bindings.library_for(*both) if weight.dtype == torch.float32 else None
        if lib is not None:
            return bindings.rms_norm(lib, x, residual, weight, eps)
    return elementwise.rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """kernels.elementwise.silu_mul; the C path takes a contiguous fp32 gate_up."""
    lib = bindings.library_for(gate_up) if gate_up.is_contiguous() else None
    if lib is not None:
        return bindings.silu_mul(lib, gate_up)
    return elementwise.silu_mul(gate_up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.elementwise.rope; the C path takes fp32 x [T, H, D] with D contiguous and
    contiguous tables (it returns a contiguous x)."""
    tables = (cos.squeeze(1), sin.squeeze(1))
    fits = x.dim() == 3 and x.stride(-1) == 1 and x.dtype == torch.float32
    fits = fits and x.device.type == "cpu" and all(t.is_contiguous() for t in tables)
    lib = bindings.library_for(*tables) if fits else None
    if lib is not None:
        return bindings.rope(lib, x, *tables)
    return elementwise.rope(x, cos, sin)


C_ELEMENTWISE = ElementwiseOps(
    "cpu", rms_norm, rope, silu_mul, elementwise.compose_qk_norm_rope(rms_norm, rope)
)
