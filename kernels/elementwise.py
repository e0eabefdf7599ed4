"""The decoder's elementwise steps, fused: in C (kernels/cpu_elementwise.c) for fp32 tensors on
the CPU, where torch would make one pass over the rows per op; plain torch everywhere else (and
where the C library could not be built). Same math as Hugging Face's Llama modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LlamaRMSNorm of s = x + residual (of x alone when residual is None) -> (normed, s or None).

    x [..., D]; the C path takes [N, D] with contiguous rows and a contiguous residual."""
    if residual is None or (residual.is_contiguous() and residual.shape == x.shape):
        both = (x,) if residual is None else (x, residual)
        lib = native.library_for(*both) if weight.dtype == torch.float32 else None
        if lib is not None:
            return native.rms_norm(lib, x, residual, weight, eps)
    if residual is not None:
        x = residual = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate columns, then up) -> silu(gate) * up [N, I], as LlamaMLP."""
    lib = native.library_for(gate_up) if gate_up.is_contiguous() else None
    if lib is not None:
        return native.silu_mul(lib, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, H, D] by tables cos, sin [T, 1, D] laid out as [c, c] and
    [-s, s]: x * cos + [x2, x1] * sin, with x = [x1, x2] (halves), each product and the sum
    rounded on their own: Hugging Face's q * cos + rotate_half(q) * sin, to the bit."""
    tables = (cos.squeeze(1), sin.squeeze(1))
    fits = x.dim() == 3 and x.stride(-1) == 1 and x.dtype == torch.float32
    fits = fits and x.device.type == "cpu" and all(t.is_contiguous() for t in tables)
    lib = native.library_for(*tables) if fits else None
    if lib is not None:
        return native.rope(lib, x, *tables)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
