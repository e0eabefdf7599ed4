"""The panel products' wrappers (csrc/cpu_panel_gemm*.c, their ctypes signatures in
bindings.load): a weight packed into each kind of panels (fp32, bf16 pairs, int8 with scales,
bf16 rows for fp32 arithmetic), and the products and the fused greedy head over them. panels.py
holds the packed weights.
"""

from __future__ import annotations

import ctypes

import torch

from . import huge_pages


def pack_panels(lib: ctypes.CDLL, weight: torch.Tensor, huge: bool = True) -> torch.Tensor:
    """A weight [N, K] (any layout) -> the panels cpu_panel_gemm.c reads: [ceil(N / NR), K, NR]
    with panel p, element (i, j) = weight[p * NR + j, i], zero past N (NR: the library's
    width); on huge pages where `huge` (every decode step streams them)."""
    width = lib.panel_width()
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // width) * width, cols, dtype=torch.float32)
    padded[:rows] = weight
    panels = huge_pages.empty((padded.shape[0] // width, cols, width), torch.float32, huge)
    return panels.copy_(padded.view(-1, width, cols).transpose(1, 2))


def pack_panels_bf16(lib: ctypes.CDLL, weight: torch.Tensor, huge: bool = True) -> torch.Tensor:
    """A bf16 weight [N, K] (any layout) -> the panels cpu_panel_gemm_bf16.c reads, as int32
    pairs [ceil(N / NR), ceil(K / 2), NR]: pair (i, j) of panel p holds weight[p * NR + j, 2i] in
    its low half and weight[p * NR + j, 2i + 1] in its high half, zero past N and K (NR: the
    library's bf16 width); on huge pages where `huge`."""
    width = lib.panel_width_bf16()
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // width) * width, -(-cols // 2) * 2, dtype=torch.bfloat16)
    padded[:rows, :cols] = weight
    pairs = padded.view(torch.int32)  # little-endian: element 2i is the low half
    shape = (pairs.shape[0] // width, pairs.shape[1], width)
    panels = huge_pages.empty(shape, torch.int32, huge)
    return panels.copy_(pairs.view(-1, width, pairs.shape[1]).transpose(1, 2))


def pack_panels_int8(
    lib: ctypes.CDLL, weight: torch.Tensor, scale: torch.Tensor, huge: bool = True
) -> torch.Tensor:
    """An int8 weight [N, K] (any layout) and its scales [N] fp32 -> the panels
    cpu_panel_gemm_int8.c reads, int8 [ceil(N / NR), panel_bytes_int8(K)], zero past N and
    after the last row (NR: the library's int8 width); on huge pages where `huge`. Panel p
    holds the scales of columns p * NR .. p * NR + NR - 1 as fp32, then
    - for the widening tile: K rows of NR int8, element (i, j) = weight[p * NR + j, i];
    - for the int8 x int8 tile (lib.panel_int8_dot(), csrc/cpu_panel_int8_dot.h): the columns'
      corrections 128 * sum_i weight[p * NR + j, i] as int32, then ceil(K / 4) groups of NR x 4
      int8, group g's (j, b) = weight[p * NR + j, 4g + b] (zero past K).
    ValueError for K past lib.panel_max_k_int8()."""
    width = lib.panel_width_int8()
    rows, cols = weight.shape
    if cols > lib.panel_max_k_int8():
        raise ValueError(f"int8 panels take at most {lib.panel_max_k_int8()} columns, not {cols}")
    count = -(-rows // width)
    dot = bool(lib.panel_int8_dot())
    depth = -(-cols // 4) * 4 if dot else cols
    padded = torch.zeros(count * width, depth, dtype=torch.int8)
    padded[:rows, :cols] = weight
    scales = torch.zeros(count * width, dtype=torch.float32)
    scales[:rows] = scale
    panels = huge_pages.zeros((count, lib.panel_bytes_int8(cols)), torch.int8, huge)
    panels[:, : 4 * width].view(torch.float32).copy_(scales.view(count, width))
    if not dot:
        body = panels[:, 4 * width : 4 * width + cols * width].view(count, cols, width)
        body.copy_(padded.view(count, width, cols).transpose(1, 2))
        return panels
    corrections = padded.to(torch.int32).sum(dim=1) * 128
    panels[:, 4 * width : 8 * width].view(torch.int32).copy_(corrections.view(count, width))
    groups = depth // 4
    body = panels[:, 8 * width : 8 * width + depth * width].view(count, groups, width, 4)
    body.copy_(padded.view(count, width, groups, 4).transpose(1, 2))
    return panels


def pack_panels_bf16_weights(
    lib: ctypes.CDLL, weight: torch.Tensor, huge: bool = True
) -> torch.Tensor:
    """A weight [N, K] (any layout; fp32 is rounded to bf16, nearest even) -> the panels
    cpu_panel_gemm_bf16_weights.c reads, bf16 [ceil(N / NR), panel_bytes_bf16_weights(K) / 2]:
    panel p holds K rows of NR bf16, element (i, j) = weight[p * NR + j, i]; zero past N and
    after the last row (NR: the library's width for them); on huge pages where `huge`."""
    width = lib.panel_width_bf16_weights()
    rows, cols = weight.shape
    count = -(-rows // width)
    padded = torch.zeros(count * width, cols, dtype=torch.bfloat16)
    padded[:rows] = weight
    panels = huge_pages.zeros(
        (count, lib.panel_bytes_bf16_weights(cols) // 2), torch.bfloat16, huge
    )
    body = panels[:, : cols * width].view(count, cols, width)
    body.copy_(padded.view(count, width, cols).transpose(1, 2))
    return panels


def _check(kernel, status: int) -> None:
    """The panel kernels return -1 when their scratch buffer's malloc failed; the int8 one -2
    for a k past panel_max_k_int8 (pack_panels_int8 refuses such a weight first)."""
    if status == -2:
        raise ValueError(f"{kernel.__name__}: k past the int8 panels' limit")
    if status != 0:
        raise MemoryError(f"{kernel.__name__} could not allocate its buffer")


def _fp32_product(kernel, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """Run a panel kernel of the fp32-output signature (x, M, K, x's row stride, panels, n,
    out) into a new [M, n] fp32 tensor."""
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = kernel(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), panels.data_ptr(), n, out.data_ptr()
    )
    _check(kernel, status)
    return out


def panel_linear_int8(
    lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int
) -> torch.Tensor:
    """x [M, K] fp32 (rows may be strided, columns contiguous), panels from pack_panels_int8 of
    an int8 weight [n, K] and its scales -> (x @ weight.T) * scale [M, n] fp32 (see
    cpu_panel_gemm_int8.c): where lib.panel_int8_dot(), each row of x quantized to int8 first
    and the int8 products summed exactly (reference.int8_dot_product), else within fp32
    summation-order error of the product with the dequantized weight."""
    return _fp32_product(lib.panel_linear_int8, x, panels, n)


def panel_linear_bf16_weights(
    lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int
) -> torch.Tensor:
    """x [M, K] fp32 (rows may be strided, columns contiguous), panels from
    pack_panels_bf16_weights of a weight [n, K] -> x @ weight.T [M, n] fp32, the weight widened
    to fp32: panel_linear's result with that fp32 weight, to the bit (see
    cpu_panel_gemm_bf16_weights.c)."""
    return _fp32_product(lib.panel_linear_bf16_weights, x, panels, n)


def panel_linear_bf16(
    lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """x [M, K] bf16 (rows may be strided, columns contiguous), panels from pack_panels_bf16 of
    a weight [n, K] -> x @ weight.T [M, n] in `dtype`: bf16 (rounded to nearest even) or fp32
    (see cpu_panel_gemm_bf16.c)."""
    out = torch.empty(x.shape[0], n, dtype=dtype)
    wide = dtype == torch.float32
    status = lib.panel_linear_bf16(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
        panels.data_ptr(),
        n,
        out.data_ptr() if wide else None,
        None if wide else out.data_ptr(),
    )
    _check(lib.panel_linear_bf16, status)
    return out


def panel_linear(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] fp32 (rows may be strided, columns contiguous), panels from pack_panels of a
    weight [n, K] -> x @ weight.T [M, n] (see cpu_panel_gemm.c)."""
    return _fp32_product(lib.panel_linear, x, panels, n)


def greedy_head(
    lib: ctypes.CDLL, hidden: torch.Tensor, panels: torch.Tensor, vocab: int
) -> torch.Tensor:
    """hidden [N, H] fp32 (rows may be strided, columns contiguous), panels from pack_panels
    -> [N] int64: (hidden @ weight.T).max(dim=-1).indices, the logits never written (see
    cpu_panel_gemm.c). bf16 hidden with panels from pack_panels_bf16: the same over fp32 sums of
    the bf16 products (cpu_panel_gemm_bf16.c)."""
    out = torch.empty(hidden.shape[0], dtype=torch.int64)
    function = lib.greedy_head_bf16 if hidden.dtype == torch.bfloat16 else lib.greedy_head
    status = function(
        hidden.data_ptr(),
        hidden.shape[0],
        hidden.shape[1],
        hidden.stride(0),
        panels.data_ptr(),
        vocab,
        out.data_ptr(),
    )
    if status != 0:
        raise MemoryError("greedy_head could not allocate its buffers")
    return out
