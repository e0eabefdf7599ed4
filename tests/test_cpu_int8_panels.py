"""The int8 weight quantization (kernels/cpu/quantize.py) and the int8 panel product
(kernels/cpu/csrc/cpu_panel_gemm_int8.c via panels.py): each element's round trip within half its
row's scale; the widening tile's product within fp32 summation-order error of the product with
the dequantized weight, and where the library multiplies int8 by int8 instead (AVX512-VNNI) the
exact int8 sums of each quantized row, scaled (quantize.int8_dot_product; the cases of that path
are tests/test_cpu_int8_dot.py's); on each vector width this CPU can run (the library built for
it, and an AVX2 build where it has wider vectors, which widens); an int8 PackedLinear serves
every batch size from its panels alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actorserve.kernels.cpu import bindings, panel_bindings
from actorserve.kernels.cpu.panels import PANEL_ROWS, PackedLinear, PanelLinear
from actorserve.kernels.cpu.quantize import dequantize_int8, int8_dot_product, quantize_int8
from kernel_support import MARCHES, cpu_flags

U = 2.0**-24  # fp32's unit roundoff


@pytest.fixture(scope="module", params=MARCHES)
def march(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def lib(march):
    lib = bindings.load(march)
    assert lib is not None, f"the CPU kernels could not be built for {march}"
    return lib


def quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return quantize_int8(torch.randn(n, k) * torch.rand(n, 1) * 3)  # rows of different scales


def exact(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale).T in float64: exact products (q * scale and a float times it fit)."""
    return x.double() @ (q.double() * scale.double()[:, None]).T


def sum_order_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How far an fp32 sum of the k products, then a product with the scale, may lie from the
    exact value, in any order of the sums: (k + 1) roundings of at most U each, relative to
    the sum of the products' magnitudes."""
    k = x.shape[1] + 1
    weight = (q.double() * scale.double()[:, None]).abs()
    return k * U / (1 - k * U) * (x.double().abs() @ weight.T)


def product(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    panels = panel_bindings.pack_panels_int8(lib, q, scale)
    return panel_bindings.panel_linear_int8(lib, x, panels, len(q))


def assert_the_tiles_product(lib, out: torch.Tensor, x, q, scale) -> None:
    """out is x @ (q * scale).T as the library's tile defines it: the exact int8 sums of the
    quantized rows, scaled, to the bit (int8 x int8), or within fp32 summation-order error of
    the exact product with the dequantized weight (widening)."""
    if lib.panel_int8_dot():
        assert torch.equal(out, int8_dot_product(x, q, scale))
    else:
        assert ((out.double() - exact(x, q, scale)).abs() <= 2 * sum_order_bound(x, q, scale)).all()


def test_each_element_rounds_to_within_half_its_rows_scale():
    torch.manual_seed(0)
    w = torch.randn(300, 77) * torch.logspace(-6, 3, 300)[:, None]
    w[5] = 0.0  # a row of zeros
    w[7, 3] = -w[7].abs().max() * 2  # a row whose largest magnitude is negative
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (300,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    half = scale.double()[:, None] / 2
    error = (q.double() * scale.double()[:, None] - w.double()).abs()  # exact dequantization
    assert (error <= half * (1 + 2.0**-40)).all()
    in_fp32 = (dequantize_int8(q, scale).double() - w.double()).abs()  # its product rounded too
    assert (in_fp32 <= half * (1 + 2.0**-40) + U * w.double().abs()).all()
    assert (q[5] == 0).all() and (dequantize_int8(q, scale)[5] == 0).all()
    assert q[7, 3] == -127  # the largest magnitude is exact: it is 127 scales
    assert torch.equal(quantize_int8(-w)[0], -q)  # symmetric


def test_quantizing_a_bf16_weight_quantizes_its_values():
    w = torch.randn(40, 64).bfloat16()
    q, scale = quantize_int8(w)
    expected_q, expected_scale = quantize_int8(w.float())
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@pytest.mark.parametrize(
    "m, k, n",
    [(1, 1024, 3072), (1, 7, 50), (3, 33, 97), (4, 64, 48), (8, 1023, 100), (9, 255, 49),
     (17, 100, 200), (64, 2816, 1024), (PANEL_ROWS, 129, 77), (PANEL_ROWS + 5, 31, 130),
     (300, 96, 145)],
)  # fmt: skip
def test_int8_product_is_what_its_tile_defines(lib, m, k, n):
    """The widening tile: the dequantized product up to fp32 summation order (and so within
    twice that of torch's fp32 product); int8 x int8: the quantized rows' exact sums, scaled."""
    q, scale = quantized(n, k, seed=m * k + n)
    x = torch.randn(m, k)
    out = product(lib, x, q, scale)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_the_tiles_product(lib, out, x, q, scale)
    if not lib.panel_int8_dot():
        torch_fp32 = F.linear(x, dequantize_int8(q, scale))  # itself within the bound of `ref`
        bound = sum_order_bound(x, q, scale)
        assert ((out.double() - torch_fp32.double()).abs() <= 4 * bound).all()


def test_int8_product_is_exact_where_every_sum_is(lib):
    """Integers times power-of-two scales: every sum and product exact, in any order; each row
    of x reaches 127, so its int8 quantization (scale 1) is itself, and both tiles are exact."""
    torch.manual_seed(3)
    q = torch.randint(-127, 128, (61, 45), dtype=torch.int8)
    scale = 2.0 ** torch.randint(-8, 3, (61,)).float()
    x = torch.randint(-127, 128, (13, 45)).float()
    x[torch.arange(13), torch.randint(0, 45, (13,))] = 127.0
    assert torch.equal(product(lib, x, q, scale).double(), exact(x, q, scale))


def test_a_row_of_the_product_does_not_depend_on_the_other_rows(lib):
    """Decode rows are batched in any grouping: each row's result is the same bits alone."""
    q, scale = quantized(100, 200, seed=4)
    x = torch.randn(11, 200)
    together = product(lib, x, q, scale)
    for row in (0, 5, 10):
        assert torch.equal(product(lib, x[row : row + 1], q, scale)[0], together[row])


def test_int8_product_reads_strided_rows(lib):
    q, scale = quantized(60, 64, seed=5)
    wide = torch.randn(12, 200)
    x = wide[:, 10:74]  # rows 200 apart
    panels = panel_bindings.pack_panels_int8(lib, q, scale)
    strided = panel_bindings.panel_linear_int8(lib, x, panels, 60)
    assert torch.equal(strided, panel_bindings.panel_linear_int8(lib, x.contiguous(), panels, 60))


def test_the_builds_have_the_vector_widths_they_are_built_for(march, lib):
    """Panels of three vectors: of 16 lanes with AVX-512, of 8 with AVX2 (so where this CPU
    has AVX-512, both paths ran above); each panel a whole number of cache lines."""
    avx512 = march == "native" and "avx512f" in cpu_flags()
    assert lib.panel_width_int8() == (48 if avx512 else 24)
    assert lib.panel_bytes_int8(1023) % 64 == 0


def test_an_int8_panel_linear_packs_only_fp32_weights():
    w = torch.randn(64, 32)
    panel = PanelLinear.for_weight(w, int8=True)
    assert panel.int8 and panel.panels.dtype == torch.int8 and panel.dtype == torch.float32
    assert PanelLinear.for_weight(w.bfloat16(), int8=True) is None
    assert PanelLinear.for_weight(w.half(), int8=True) is None
    assert not PanelLinear.for_weight(w).int8


@pytest.mark.parametrize("rows", [1, 16, PANEL_ROWS, 300])
def test_an_int8_packed_linear_serves_every_batch_from_its_panels_alone(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=False)
    q, scale = quantize_int8(linear.weight.data)
    packed = PackedLinear(linear, PanelLinear.for_weight(linear.weight.data, int8=True))
    assert packed.weight is None and list(packed.parameters()) == []
    x = torch.randn(rows, 96)
    out = packed(x)
    assert out.shape == (rows, 80) and out.dtype == torch.float32
    assert_the_tiles_product(packed.panel._lib, out, x, q, scale)
    assert torch.equal(packed(x.view(1, rows, 96))[0], out)  # leading dims are rows too
