"""The bf16 panel products (kernels/cpu/csrc/cpu_panel_gemm_bf16.c via panels.py): each product
within bf16 rounding of the fp32 product of the same bf16 values, the fused greedy head the first
maximum of the logits it also returns, and bf16 weights packed only where the CPU multiplies
bf16 in hardware (or a test says so)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.panels import GreedyHead, PackedLinear, PanelLinear

BF16_ROUNDING = 2.0**-8  # how far, relative, a rounding to bf16 (8 significant bits) moves a value


@pytest.fixture(scope="module", autouse=True)
def library():
    assert bindings.load() is not None, "the CPU kernels could not be built (no C compiler?)"


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T of bf16 values, in float64 (every product of two bf16 is exact there)."""
    return x.double() @ w.double().T


def sum_order_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far an fp32 sum of the k products may lie from the exact one, in any order."""
    k, u = x.shape[1], 2.0**-24
    return k * u / (1 - k * u) * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize(
    "m, k, n",
    [(1, 1024, 3072), (8, 64, 48), (9, 7, 50), (16, 1023, 100), (64, 2816, 1024), (128, 33, 97)],
)
def test_bf16_panel_product_is_within_bf16_rounding_of_the_exact_product(m, k, n):
    torch.manual_seed(m * k + n)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    out = PanelLinear.for_weight(w, bf16=True)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = exact(x, w)
    allowed = BF16_ROUNDING * ref.abs() + 2 * sum_order_bound(x, w)
    assert ((out.double() - ref).abs() <= allowed).all()


def test_bf16_panel_product_rounds_to_nearest_even_as_torch():
    """Where the fp32 sum is exact (small integers), the result is torch's rounding of it."""
    torch.manual_seed(0)
    w = torch.randint(-8, 9, (96, 40)).bfloat16()
    x = torch.randint(-8, 9, (5, 40)).bfloat16()
    out = PanelLinear.for_weight(w, bf16=True)(x)
    assert torch.equal(out, exact(x, w).float().bfloat16())


def test_bf16_panel_product_reads_strided_rows():
    torch.manual_seed(1)
    w = torch.randn(60, 64).bfloat16()
    wide = torch.randn(12, 200).bfloat16()
    x = wide[:, 10:74]  # rows 200 apart
    panel = PanelLinear.for_weight(w, bf16=True)
    assert torch.equal(panel(x), panel(x.contiguous()))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
def test_bf16_greedy_head_picks_the_first_maximum_of_its_logits(rows):
    torch.manual_seed(rows)
    w, hidden = torch.randn(1000, 96).bfloat16(), torch.randn(rows, 96).bfloat16()
    w[7] = w[500] = w[999] = hidden[0] * 4  # a tie, well above the rest, for row 0
    head = GreedyHead.for_weight(w, bf16=True)
    logits = head.logits(hidden)
    assert logits.dtype == torch.float32
    assert ((logits.double() - exact(hidden, w)).abs() <= 2 * sum_order_bound(hidden, w)).all()
    tokens = head(hidden)
    assert torch.equal(tokens, logits.max(dim=-1).indices)
    assert tokens[0] == 7


def test_bf16_weights_are_packed_only_where_bf16_products_are_native():
    w = torch.randn(64, 32).bfloat16()
    assert PanelLinear.for_weight(w, bf16=False) is None
    assert GreedyHead.for_weight(w, bf16=False) is None
    assert PanelLinear.for_weight(w, bf16=True).panels.dtype == torch.int32
    assert PanelLinear.for_weight(w.half(), bf16=True) is None


def test_packed_linear_sends_bf16_decode_rows_to_the_panels_and_others_to_torch():
    torch.manual_seed(2)
    linear = nn.Linear(64, 80, bias=False).bfloat16()
    packed = PackedLinear(linear, PanelLinear.for_weight(linear.weight.data, bf16=True))
    calls = []
    packed.panel = (lambda panel: lambda x: calls.append(x.shape[0]) or panel(x))(packed.panel)
    packed.panel.dtype = torch.bfloat16
    small, large = torch.randn(16, 64).bfloat16(), torch.randn(300, 64).bfloat16()
    assert torch.equal(packed(large), linear(large))  # prefill-sized: torch
    out = packed(small)
    assert calls == [16] and out.dtype == torch.bfloat16
    assert (out.double() - exact(small, linear.weight)).abs().max() < 0.1


def test_the_bf16_panels_run_on_vdpbf16ps_where_the_cpu_has_avx512_bf16():
    """The library is built for this CPU (-march=native): its AVX512-BF16 products, else the
    widened FMA loop."""
    try:
        with open("/proc/cpuinfo") as f:
            has = any("avx512_bf16" in line.split() for line in f if line.startswith("flags"))
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert bindings.load().panel_bf16_native() == int(has)
