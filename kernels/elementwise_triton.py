"""The decoder's elementwise steps as fused Triton kernels: the `triton` ElementwiseOps, chosen
with the triton attention backend (kernels.elementwise_ops). One pass over the data per step
instead of torch's one per op:

    rms_norm      s = x + residual and RMSNorm(s) together (s written out as the new residual)
    silu_mul      gate_up [N, 2I] -> silu(gate) * up [N, I]
    qk_norm_rope  qkv [T, (Hq + 2 Hkv) D] -> q, k with the per-head RMSNorm (Qwen3) and the
                  neox rope applied, both contiguous; v a view of qkv (store_kv takes strides)

Same math as kernels/elementwise.py: fp32 inside, each intermediate rounded to the tensor's dtype
where torch rounds it (the sum, the normed value before the weight, each rope product), so the
results differ from torch's only by the order of the norm's fp32 sum and the last bit of exp and
rsqrt. Inputs the kernels do not take (dtypes other than fp16 / bf16 / fp32, tensors of mixed
dtypes, a last dimension that is not contiguous) go to the torch versions.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import elementwise
from .elementwise import ElementwiseOps

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements one program holds per tensor: a few per thread at 4 warps, so nothing spills.
PROGRAM_ELEMENTS = 1024
SILU_BLOCK = 1024


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    num_rows,
    stride_x,
    stride_r,
    eps,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_ROWS),): rows of x [N, DIM] (row stride stride_x); out and sum are
    contiguous [N, DIM]; sum is written only with HAS_RESIDUAL."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < DIM
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * DIM + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, 1) / DIM + eps)
    normed = (h * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * DIM + cols[None, :], out, mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (N, cdiv(INTER, BLOCK)): out[n] = silu(gate_up[n, :INTER]) * gate_up[n, INTER:],
    silu rounded to the dtype before the product, as torch's two ops round."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTER + cols, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, (act * up.to(tl.float32)).to(up.dtype), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,
    q_out_ptr,
    k_out_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    num_q_heads,
    num_k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Grid (T, cdiv(Hq, BLOCK_H) + cdiv(Hk, BLOCK_H)): heads 0..Hq-1 of x [T, Hq + Hk, D]
    (strides stride_xt, stride_xh, 1) go to q_out [T, Hq, D], heads Hq.. to k_out [T, Hk, D],
    each normed by its weight (with HAS_NORM) and rotated: out = x * cos + [x2, x1] * sin."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if block < q_blocks:
        first_head = block * BLOCK_H
        in_head = first_head
        num_heads = num_q_heads
        out_ptr = q_out_ptr
        weight_ptr = q_weight_ptr
    else:
        first_head = (block - q_blocks) * BLOCK_H
        in_head = num_q_heads + first_head
        num_heads = num_k_heads
        out_ptr = k_out_ptr
        weight_ptr = k_weight_ptr
    offs_h = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, D_PAD)
    col_ok = cols < HEAD_DIM
    # [x2, x1]: the column each one is rotated with
    rolled = tl.where(cols < HEAD_DIM // 2, cols + HEAD_DIM // 2, cols - HEAD_DIM // 2)
    mask = (first_head + offs_h < num_heads)[:, None] & col_ok[None, :]
    src = x_ptr + token * stride_xt + (in_head + offs_h).to(tl.int64)[:, None] * stride_xh
    x = tl.load(src + cols[None, :], mask=mask, other=0.0)
    x_rolled = tl.load(src + rolled[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_NORM:
        h = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w_rolled = tl.load(weight_ptr + rolled, mask=col_ok, other=0.0).to(tl.float32)
        x = ((h * rstd).to(dtype).to(tl.float32) * w[None, :]).to(dtype)
        h_rolled = x_rolled.to(tl.float32)
        x_rolled = ((h_rolled * rstd).to(dtype).to(tl.float32) * w_rolled[None, :]).to(dtype)
    cos = tl.load(cos_ptr + token * stride_ct + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + cols, mask=col_ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32)
    b = (x_rolled.to(tl.float32) * sin[None, :]).to(dtype).to(tl.float32)
    dst = out_ptr + (token * num_heads + first_head + offs_h)[:, None] * HEAD_DIM + cols[None, :]
    tl.store(dst, (a + b).to(dtype), mask=mask)


def _kernel_takes(*tensors: torch.Tensor) -> bool:
    """One dtype the kernels handle, one device, each last dimension contiguous."""
    first = tensors[0]
    return first.dtype in KERNEL_DTYPES and all(
        t.dtype == first.dtype and t.device == first.device and t.stride(-1) == 1 for t in tensors
    )


@functools.lru_cache(maxsize=64)
def _norm_tiling(dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps) of the RMSNorm kernel for rows of dim elements."""
    block_d = triton.next_power_of_2(dim)
    block_rows = max(1, PROGRAM_ELEMENTS // block_d)
    return block_d, block_rows, 4 if block_d * block_rows <= 2048 else 8


@functools.lru_cache(maxsize=64)
def _norm_rope_tiling(head_dim: int, num_q_heads: int, num_k_heads: int) -> tuple[int, int, int]:
    """(D_PAD, BLOCK_H, head blocks per token) of the q/k norm + rope kernel."""
    d_pad = triton.next_power_of_2(head_dim)
    widest = triton.next_power_of_2(max(num_q_heads, num_k_heads))
    block_h = max(1, min(widest, PROGRAM_ELEMENTS // d_pad))
    return d_pad, block_h, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [N, D] (a view where the strides allow, as for a 2-D x)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.elementwise.rms_norm in one pass: (normed, s) as contiguous tensors of x's shape."""
    both = (x, weight) if residual is None else (x, residual, weight)
    dim = x.shape[-1]
    fits = _kernel_takes(*both) and tuple(weight.shape) == (dim,)
    if not fits or (residual is not None and residual.shape != x.shape):
        return elementwise.rms_norm(x, residual, weight, eps)
    rows = _rows(x)
    res_rows = rows if residual is None else _rows(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(out)
    if rows.shape[0] == 0:
        return out, summed
    block_d, block_rows, num_warps = _norm_tiling(dim)
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
        rows,
        res_rows,
        weight,
        out,
        out if summed is None else summed,
        rows.shape[0],
        rows.stride(0),
        res_rows.stride(0),
        float(eps),
        DIM=dim,
        BLOCK_D=block_d,
        BLOCK_ROWS=block_rows,
        HAS_RESIDUAL=residual is not None,
        num_warps=num_warps,
    )
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """kernels.elementwise.silu_mul in one pass: gate_up [N, 2I] -> [N, I], contiguous."""
    if gate_up.dim() != 2 or not _kernel_takes(gate_up):
        return elementwise.silu_mul(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), INTER=inter, BLOCK=block, num_warps=4)
    return out


def _launch_norm_rope(
    x: torch.Tensor,
    num_q_heads: int,
    num_k_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hq + Hk, D] (last dim contiguous) -> q [T, Hq, D], k [T, Hk, D], contiguous."""
    num_tokens, _, head_dim = x.shape
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    k = torch.empty((num_tokens, num_k_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return q, k
    d_pad, block_h, head_blocks = _norm_rope_tiling(head_dim, num_q_heads, num_k_heads)
    _qk_norm_rope_kernel[(num_tokens, head_blocks)](
        x,
        q,
        k,
        x if q_weight is None else q_weight,  # not read without the norm
        x if k_weight is None else k_weight,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_q_heads,
        num_k_heads,
        float(eps),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_H=block_h,
        HAS_NORM=q_weight is not None,
        num_warps=4,
        enable_fp_fusion=False,  # x * cos + x' * sin as two rounded products, torch's to the bit
    )
    return q, k


def _tables_fit(num_tokens: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """cos, sin [T, 1, D] (or [T, D]) with rows the kernel can step through."""
    return all(
        t.shape[0] == num_tokens and t.shape[-1] == head_dim and t.numel() == num_tokens * head_dim
        for t in (cos, sin)
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.elementwise.rope in one pass: x [T, H, D] -> the rotated x, contiguous."""
    fits = x.dim() == 3 and _kernel_takes(x, cos, sin)
    if not fits or not _tables_fit(x.shape[0], x.shape[-1], cos, sin):
        return elementwise.rope(x, cos, sin)
    return _launch_norm_rope(x, x.shape[1], 0, cos, sin, None, None, 0.0)[0]


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
    """kernels.elementwise.compose_qk_norm_rope's step in one launch for q and k together."""
    weights = () if q_weight is None else (q_weight, k_weight)
    num_heads, head_dim = num_q_heads + 2 * num_kv_heads, cos.shape[-1]
    fits = qkv.dim() == 2 and qkv.shape[-1] == num_heads * head_dim
    fits = fits and _kernel_takes(qkv, cos, sin, *weights)
    fits = fits and all(tuple(w.shape) == (head_dim,) for w in weights)
    if not fits or not _tables_fit(qkv.shape[0], head_dim, cos, sin):
        return TORCH_QK_NORM_ROPE(qkv, num_q_heads, num_kv_heads, cos, sin, q_weight, k_weight, eps)
    heads = qkv.view(qkv.shape[0], num_heads, head_dim)
    q, k = _launch_norm_rope(heads, num_q_heads, num_kv_heads, cos, sin, q_weight, k_weight, eps)
    return q, k, heads[:, num_q_heads + num_kv_heads :]


TORCH_QK_NORM_ROPE = elementwise.compose_qk_norm_rope(elementwise.rms_norm, elementwise.rope)
TRITON_ELEMENTWISE = ElementwiseOps("triton", rms_norm, rope, silu_mul, qk_norm_rope)


def warm_up(
    hidden_size: int,
    intermediate_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: bool,
    dtype: torch.dtype,
    device: torch.device | str,
) -> int:
    """Launch each kernel variant a model of these shapes uses (RMSNorm with and without the
    residual, SiLU x up, q/k norm + rope) on dummy rows laid out as the model's, so Triton
    compiles them now rather than in a request. Returns the number of variants launched."""
    zeros = dict(dtype=dtype, device=device)
    x = torch.zeros((2, hidden_size), **zeros)
    weight = torch.ones(hidden_size, **zeros)
    rms_norm(x, None, weight, 1e-6)
    rms_norm(x, x.clone(), weight, 1e-6)
    silu_mul(torch.zeros((2, 2 * intermediate_size), **zeros))
    qkv = torch.zeros((2, (num_q_heads + 2 * num_kv_heads) * head_dim), **zeros)
    cos = torch.ones((2, 1, head_dim), **zeros)
    norm = (torch.ones(head_dim, **zeros),) * 2 if qk_norm else (None, None)
    qk_norm_rope(qkv, num_q_heads, num_kv_heads, cos, cos, *norm, 1e-6)
    return 4
