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


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of activations x [M, K] fp32 -> (q [M, K] int8, scale [M] fp32), as the int8 x int8
    panels quantize them (csrc/cpu_panel_int8_dot.h): scale = max |x| / 127 in fp32 (1 for a row
    of zeros; NaN for one with an inf or a NaN, whose products are then NaN, not rounded into
    finite ones), q = x / scale in fp32 rounded to nearest even, clamped to [-127, 127] (what q
    is for a NaN scale does not matter)."""
    largest = x.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest / INT8_MAX, torch.ones_like(largest))
    scale = torch.where(x.isfinite().all(dim=1), scale, torch.nan)
    q = torch.round(x / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0)
    return q.to(torch.int8), scale


def int8_dot_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the int8 x int8 panels compute for rows x [M, K] fp32 and a weight (q [N, K] int8,
    scale [N]): each row quantized (quantize_rows_int8), the exact integer sums of the products
    (in float64, exact: every sum is below 2^53), rounded to fp32, times the fp32 product of the
    row's and the column's scales -> [M, N] fp32."""
    xq, x_scale = quantize_rows_int8(x)
    sums = (xq.double() @ q.double().T).float()
    return sums * (x_scale[:, None] * scale[None, :])
