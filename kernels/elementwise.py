"""The decoder's elementwise steps in plain torch, the same math as Hugging Face's Llama modules,
behind `ElementwiseOps`: the model calls them through the bundle it was built with, so a backend
can give fused versions (kernels/cpu/elementwise.py in C, kernels/elementwise_triton.py in
Triton) without the model knowing."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class ElementwiseOps(NamedTuple):
    """The elementwise steps the model calls; signatures are those of the functions below
    (qk_norm_rope: of the one compose_qk_norm_rope returns). The attention layer reaches rope
    only through qk_norm_rope."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    rope: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


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


def split_qkv(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] (columns q, k, v) -> views q [T, Hq, D], k, v [T, Hkv, D]."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[-1] // (num_q_heads + 2 * num_kv_heads)
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = qkv.split(sizes, dim=-1)
    return (
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def compose_qk_norm_rope(rms_norm_fn: Callable, rope_fn: Callable) -> Callable:
    """The attention layer's step from the qkv projection to what attention reads, made of a
    bundle's own rms_norm and rope (so a bundle's results stay its own, to the bit):

    qk_norm_rope(qkv, num_q_heads, num_kv_heads, cos, sin, q_weight, k_weight, eps) -> q, k, v
        qkv [T, (Hq + 2 Hkv) D]; cos, sin [T, 1, D] as `rope` takes them; q_weight, k_weight
        [D] the per-head RMSNorm weights (Qwen3), or None for no q/k norm (then eps is unused).
        q [T, Hq, D] and k [T, Hkv, D] normed, then rotated; v [T, Hkv, D] a view of qkv."""

    def qk_norm_rope(
        qkv: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads)
        if q_weight is not None:
            q, k = rms_norm_fn(q, None, q_weight, eps)[0], rms_norm_fn(k, None, k_weight, eps)[0]
        return rope_fn(q, cos, sin), rope_fn(k, cos, sin), v

    return qk_norm_rope


TORCH_ELEMENTWISE = ElementwiseOps(
    "torch", rms_norm, rope, silu_mul, compose_qk_norm_rope(rms_norm, rope)
)
