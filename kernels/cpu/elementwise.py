"""The decoder's elementwise steps fused in C for fp32 tensors (csrc/cpu_elementwise.c) and bf16
tensors (csrc/cpu_elementwise_bf16.c) on the CPU, where torch makes one pass over the rows per
op; kernels/elementwise.py's torch versions serve every input the C does not take. Same results
as those: to the bit for rope, and in bf16 to the bit for all three (rounded where torch
rounds, its sums of squares added in its order)."""

from __future__ import annotations

import torch

from .. import elementwise
from ..elementwise import ElementwiseOps
from . import bindings

DTYPES = (torch.float32, torch.bfloat16)  # what the C kernels take


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.elementwise.rms_norm; the C path takes x [N, D] with contiguous rows, a
    contiguous residual of its shape and a contiguous weight, all of one dtype; or x [..., D]
    without a residual (Qwen3's q/k heads, [T, H, D] views of the qkv rows), as its rows [N, D]
    (copied where they are not evenly spaced): the decode stack norms each head in C, so the
    layers must too for an fp32 model's steps to be the stack's to the bit."""
    if residual is None and x.dim() > 2 and x.stride(-1) == 1:
        normed, _ = rms_norm(x.reshape(-1, x.shape[-1]), None, weight, eps)
        return normed.view(x.shape), None
    if residual is None or (residual.is_contiguous() and residual.shape == x.shape):
        both = (x,) if residual is None else (x, residual)
        fits = weight.dtype == x.dtype and weight.is_contiguous()
        lib = bindings.library_for(*both, dtypes=DTYPES) if fits else None
        if lib is not None:
            return bindings.rms_norm(lib, x, residual, weight, eps)
    return elementwise.rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """kernels.elementwise.silu_mul; the C path takes a contiguous fp32 or bf16 gate_up."""
    lib = bindings.library_for(gate_up, dtypes=DTYPES) if gate_up.is_contiguous() else None
    if lib is not None:
        return bindings.silu_mul(lib, gate_up)
    return elementwise.silu_mul(gate_up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.elementwise.rope; the C path takes fp32 or bf16 x [T, H, D] with D even and
    contiguous, and contiguous tables of x's dtype (it returns a contiguous x)."""
    tables = (cos.squeeze(1), sin.squeeze(1))
    fits = x.dim() == 3 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and x.dtype in DTYPES
    fits = fits and x.device.type == "cpu" and all(t.is_contiguous() for t in tables)
    fits = fits and cos.dtype == x.dtype
    lib = bindings.library_for(*tables, dtypes=DTYPES) if fits else None
    if lib is not None:
        return bindings.rope(lib, x, *tables)
    return elementwise.rope(x, cos, sin)


C_ELEMENTWISE = ElementwiseOps(
    "cpu", rms_norm, rope, silu_mul, elementwise.compose_qk_norm_rope(rms_norm, rope)
)
