"""The bf16-weight panel product (kernels/cpu/csrc/cpu_panel_gemm_bf16_weights.c via panels.py;
`quantization bf16`): fp32 rows times a weight kept in bf16 and widened to fp32 in registers is
the fp32 panels' product with that weight upcast, to the bit, and within fp32 summation-order
error of the exact product, on each vector width this CPU can run (the library built for it, and
an AVX2 build where it has wider vectors), at decode sizes (1 .. PANEL_ROWS rows) and prefill
sizes; a bf16-weight PackedLinear keeps no fp32 weight and serves every batch size from its
panels, in half the fp32 panels' bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actorserve.kernels.cpu import bindings, panel_bindings
from actorserve.kernels.cpu.panels import PANEL_ROWS, PackedLinear, PanelLinear
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


def bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """An fp32 weight whose every value is a bf16 (a bf16 checkpoint's, upcast)."""
    torch.manual_seed(seed)
    return (torch.randn(n, k) * torch.rand(n, 1) * 3).bfloat16().float()


def sum_order_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far an fp32 sum of the k products may lie from the exact value, in any order of the
    sums: k roundings of at most U each, relative to the sum of the products' magnitudes."""
    k = x.shape[1]
    return k * U / (1 - k * U) * (x.double().abs() @ w.double().abs().T)


def product(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    panels = panel_bindings.pack_panels_bf16_weights(lib, w)
    return panel_bindings.panel_linear_bf16_weights(lib, x, panels, len(w))


@pytest.mark.parametrize(
    "m, k, n",
    [(1, 1024, 3072), (1, 7, 50), (2, 33, 97), (3, 64, 48), (4, 1023, 100), (5, 255, 49),
     (7, 100, 200), (8, 31, 130), (9, 96, 145), (16, 2816, 1024), (17, 129, 77),
     (PANEL_ROWS, 129, 77), (PANEL_ROWS + 5, 31, 130), (300, 96, 145)],
)  # fmt: skip
def test_bf16_weights_give_the_fp32_panels_product_of_the_upcast_weight(lib, m, k, n):
    w = bf16_weight(n, k, seed=m * k + n)
    x = torch.randn(m, k)
    out = product(lib, x, w)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    fp32 = panel_bindings.panel_linear(lib, x, panel_bindings.pack_panels(lib, w), n)
    assert torch.equal(out, fp32)  # the same FMAs on the same values, in the same order
    exact = x.double() @ w.double().T
    assert ((out.double() - exact).abs() <= sum_order_bound(x, w)).all()
    torch_fp32 = F.linear(x, w)  # torch's own order: within the bound of the exact product too
    assert ((out.double() - torch_fp32.double()).abs() <= 2 * sum_order_bound(x, w)).all()


@pytest.mark.parametrize("rows", range(1, 18))
def test_every_row_count_of_a_tile_is_the_fp32_panels_product(lib, rows):
    """A tile does only the rows of `a` there are (one kernel per count below a row block):
    every count gives the same products as the fp32 panels' full tile."""
    w = bf16_weight(61, 45, seed=rows)
    x = torch.randn(rows, 45)
    fp32 = panel_bindings.panel_linear(lib, x, panel_bindings.pack_panels(lib, w), 61)
    assert torch.equal(product(lib, x, w), fp32)


def test_an_fp32_weight_is_rounded_to_bf16_as_torch_rounds_it(lib):
    torch.manual_seed(3)
    w = torch.randn(50, 40)
    x = torch.randn(6, 40)
    rounded = w.bfloat16().float()
    assert not torch.equal(w, rounded)
    fp32 = panel_bindings.panel_linear(lib, x, panel_bindings.pack_panels(lib, rounded), 50)
    assert torch.equal(product(lib, x, w), fp32)


def test_a_row_of_the_product_does_not_depend_on_the_other_rows(lib):
    """Decode rows are batched in any grouping: each row's result is the same bits alone."""
    w = bf16_weight(100, 200, seed=4)
    x = torch.randn(11, 200)
    together = product(lib, x, w)
    for row in (0, 5, 10):
        assert torch.equal(product(lib, x[row : row + 1], w)[0], together[row])


def test_the_product_reads_strided_rows(lib):
    w = bf16_weight(60, 64, seed=5)
    x = torch.randn(12, 200)[:, 10:74]  # rows 200 apart
    panels = panel_bindings.pack_panels_bf16_weights(lib, w)
    strided = panel_bindings.panel_linear_bf16_weights(lib, x, panels, 60)
    assert torch.equal(
        strided, panel_bindings.panel_linear_bf16_weights(lib, x.contiguous(), panels, 60)
    )


def test_the_panels_are_half_the_fp32_bytes_in_whole_cache_lines(march, lib):
    """Panels of three vectors: of 16 lanes with AVX-512, of 8 with AVX2 (so where this CPU
    has AVX-512, both paths ran above); each panel a whole number of cache lines."""
    avx512 = march == "native" and "avx512f" in cpu_flags()
    assert lib.panel_width_bf16_weights() == (48 if avx512 else 24)
    assert lib.panel_bytes_bf16_weights(1023) % 64 == 0
    w = bf16_weight(1024, 1024, seed=6)
    narrow = panel_bindings.pack_panels_bf16_weights(lib, w)
    wide = panel_bindings.pack_panels(lib, w)
    assert narrow.dtype == torch.bfloat16
    assert narrow.numel() * 2 * 2 == wide.numel() * 4


def test_a_bf16_weight_panel_linear_packs_only_fp32_weights():
    w = torch.randn(64, 32)
    panel = PanelLinear.for_weight(w, bf16_weights=True)
    assert panel.bf16_weights and panel.only_copy and not panel.int8
    assert panel.panels.dtype == torch.bfloat16 and panel.dtype == torch.float32
    assert PanelLinear.for_weight(w.bfloat16(), bf16_weights=True) is None
    assert PanelLinear.for_weight(w.half(), bf16_weights=True) is None
    assert not PanelLinear.for_weight(w).only_copy


@pytest.mark.parametrize("rows", [1, 4, 16, PANEL_ROWS, 300])
def test_a_bf16_weight_packed_linear_serves_every_batch_from_its_panels_alone(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=False)
    linear.weight.data = linear.weight.data.bfloat16().float()
    fp32 = PackedLinear(linear, PanelLinear.for_weight(linear.weight.data))
    packed = PackedLinear(linear, PanelLinear.for_weight(linear.weight.data, bf16_weights=True))
    assert packed.weight is None and list(packed.parameters()) == []
    x = torch.randn(rows, 96)
    out = packed(x)
    assert out.shape == (rows, 80) and out.dtype == torch.float32
    if rows <= PANEL_ROWS:  # where the fp32 Linear also runs on its panels: the same bits
        assert torch.equal(out, fp32(x))
    bound = sum_order_bound(x, linear.weight.data)
    assert ((out.double() - x.double() @ linear.weight.data.double().T).abs() <= bound).all()
    assert torch.equal(packed(x.view(1, rows, 96))[0], out)  # leading dims are rows too
