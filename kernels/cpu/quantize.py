"""Weight-only int8 quantization (EngineConfig.quantization="int8"): symmetric, one fp32 scale per
output channel (a row of a Linear's weight [N, K]), no zero point.

    scale[n] = max_k |W[n, k]| / 127        (1 for a row of zeros: any scale gives it q = 0)
    q[n, k]  = round(W[n, k] / scale[n])    in [-127, 127], ties to even
    W ~ q * scale[:, None]

The quotient is taken in float64, where W / scale is within 2^-46 of the exact one, so each
element's round trip |q * scale - W| is at most scale / 2 (to that margin): the rounding, nothing
else. -128 is never used, so the range is symmetric and negating a weight negates its q.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (fp32 or bf16, any layout) -> (q [N, K] int8 contiguous, scale [N] fp32)."""
    rows = weight.float()
    largest = rows.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest / INT8_MAX, torch.ones_like(largest))
    q = torch.round(rows.double() / scale.double()[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8).contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [N, K] int8, scale [N] fp32) -> the weight they stand for, [N, K] fp32."""
    return q.float() * scale[:, None]
