"""The int8 panels' int8 x int8 path (kernels/cpu/csrc/cpu_panel_int8_dot.h), where the CPU has
AVX512-VNNI: the library built for such a CPU takes it and the x86-64-v3 build does not; its
result is, to the bit, each row quantized to int8 (quantize_rows_int8), the exact integer sums
of the products with the int8 weight, rounded to fp32, times the fp32 product of the row's and
the column's scales (quantize.int8_dot_product, its sums in float64, exact here). Decode sizes
(1 to 16 rows) and prefill sizes, any k (not a multiple of 4 nor of a vector) and any n (not a
multiple of a panel), rows of zeros, rows of large and of tiny magnitude."""

from __future__ import annotations

import pytest
import torch

from actorserve.kernels.cpu import bindings, panel_bindings
from actorserve.kernels.cpu.capability import cpu_has_int8_dot
from actorserve.kernels.cpu.panels import PanelLinear
from actorserve.kernels.cpu.quantize import int8_dot_product, quantize_int8, quantize_rows_int8
from kernel_support import cpu_flags

requires_vnni = pytest.mark.skipif(
    not cpu_has_int8_dot(), reason="this CPU has no AVX512-VNNI: the int8 panels widen to fp32"
)


@pytest.fixture(scope="module")
def lib():
    lib = bindings.load()
    assert lib is not None, "the CPU kernels could not be built"
    return lib


def product(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    panels = panel_bindings.pack_panels_int8(lib, q, scale)
    return panel_bindings.panel_linear_int8(lib, x, panels, len(q))


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return quantize_int8(torch.randn(n, k) * torch.rand(n, 1) * 3)


def test_the_library_multiplies_int8_by_int8_exactly_where_the_cpu_has_vnni(lib):
    assert cpu_has_int8_dot() == ("avx512_vnni" in cpu_flags())
    assert lib.panel_int8_dot() == int(cpu_has_int8_dot())


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="no AVX2 to run an x86-64-v3 build")
def test_the_x86_64_v3_build_keeps_the_widening_path():
    narrow = bindings.load("x86-64-v3")
    assert narrow is not None and narrow.panel_int8_dot() == 0
    assert narrow.panel_max_k_int8() == 2**63 - 1  # no int32 sums to overflow


@requires_vnni
@pytest.mark.parametrize("m", range(1, 17))
@pytest.mark.parametrize("k, n", [(1024, 3072), (2816, 1024), (7, 50), (33, 97), (1023, 49)])
def test_decode_rows_are_the_exact_int8_sums_scaled(lib, m, k, n):
    q, scale = weight(n, k, seed=m * k + n)
    x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
    out = product(lib, x, q, scale)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert torch.equal(out, int8_dot_product(x, q, scale))


@requires_vnni
@pytest.mark.parametrize("m, k, n", [(300, 96, 145), (517, 1027, 200), (2048, 130, 47)])
def test_prefill_rows_are_the_exact_int8_sums_scaled(lib, m, k, n):
    q, scale = weight(n, k, seed=m + k)
    x = torch.randn(m, k)
    assert torch.equal(product(lib, x, q, scale), int8_dot_product(x, q, scale))


@requires_vnni
def test_rows_of_zeros_give_zeros_and_leave_the_other_rows_alone(lib):
    q, scale = weight(100, 77, seed=1)
    x = torch.randn(9, 77)
    x[[0, 4, 8]] = 0.0
    out = product(lib, x, q, scale)
    assert (out[[0, 4, 8]] == 0).all() and not (out[1] == 0).all()
    assert torch.equal(out, int8_dot_product(x, q, scale))
    assert torch.equal(out[1:2], product(lib, x[1:2], q, scale))


@requires_vnni
@pytest.mark.parametrize("magnitude", [1e30, 1e-30, 3.0e38])
def test_rows_of_any_magnitude_quantize_by_their_own_scale(lib, magnitude):
    q, scale = weight(61, 45, seed=2)
    torch.manual_seed(3)
    x = torch.randn(5, 45)
    x[2] = x[2] / x[2].abs().max() * magnitude  # one row at the extreme, the others ordinary
    out = product(lib, x, q, scale)
    assert torch.equal(out, int8_dot_product(x, q, scale))
    assert torch.equal(out[[0, 1, 3, 4]], product(lib, x[[0, 1, 3, 4]], q, scale))


@requires_vnni
def test_the_largest_sums_stay_exact(lib):
    """Every quantized element at 127 with weights of -127: the offset sum's largest magnitude
    (255 * 127 a term) at a production k, no overflow, the integer sum exact."""
    k = 11008
    q = torch.full((49, k), -127, dtype=torch.int8)
    q[1] = 127
    scale = torch.ones(49)
    x = torch.ones(3, k)
    out = product(lib, x, q, scale)
    row_scale = torch.tensor(1.0) / 127  # each row quantized to 127s
    assert torch.equal(out[:, 0], torch.full((3,), -127.0 * 127 * k) * row_scale)
    assert torch.equal(out, int8_dot_product(x, q, scale))


@requires_vnni
def test_quantized_rows_round_to_nearest_even_within_half_their_scale():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -0.5, 63.5, -127.0]])
    q, scale = quantize_rows_int8(x)
    assert float(scale[0]) == 1.0
    assert q.tolist() == [[127, 0, 2, -2, 0, 64, -127]]


@requires_vnni
def test_a_weight_wider_than_the_int32_sums_allow_is_refused(lib):
    k = lib.panel_max_k_int8() + 1
    with pytest.raises(ValueError, match="int8 panels take at most"):
        panel_bindings.pack_panels_int8(lib, torch.zeros(1, k, dtype=torch.int8), torch.ones(1))
    wide = torch.zeros(2, k)
    assert PanelLinear.for_weight(wide, int8=True) is None  # such a projection stays as loaded
    assert PanelLinear.for_weight(wide[:, :-1], int8=True).int8


@requires_vnni
def test_a_row_with_an_inf_or_a_nan_gives_nans_and_leaves_the_other_rows_alone(lib):
    """Rounding would turn them into finite products; an fp32 product's would not be."""
    q, scale = weight(50, 40, seed=4)
    torch.manual_seed(5)
    x = torch.randn(4, 40)
    x[1, 7], x[2, 39] = float("inf"), float("nan")
    out = product(lib, x, q, scale)
    assert out[1:3].isnan().all() and out[[0, 3]].isfinite().all()
    torch.testing.assert_close(out, int8_dot_product(x, q, scale), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out[[0, 3]], product(lib, x[[0, 3]], q, scale))
