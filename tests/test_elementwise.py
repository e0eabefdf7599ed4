"""Every bundle of elementwise steps the model may be built with gives Hugging Face's Llama math:
the plain torch one (kernels/elementwise.py), the CPU fast path's (kernels/cpu/elementwise.py:
C for fp32 CPU tensors, the torch one for the rest) and the fused Triton one
(kernels/elementwise_triton.py, in the interpreter on CPU). RMSNorm with and without its residual
add, SiLU-and-multiply, and the rotary embedding (to the bit). The Triton bundle in half
precision and the fused q/k norm + rope: tests/test_elementwise_triton.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE
from actorserve.kernels.elementwise import TORCH_ELEMENTWISE, ElementwiseOps
from actorserve.kernels.elementwise_triton import TRITON_ELEMENTWISE

TOL = dict(rtol=2e-6, atol=2e-6)
# the interpreter's numpy warns where exp(-gate) overflows to inf: silu is then -0, as torch's
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(
    params=[C_ELEMENTWISE, TORCH_ELEMENTWISE, TRITON_ELEMENTWISE], ids=lambda ops: ops.name
)
def elementwise(request) -> ElementwiseOps:
    return request.param


def test_the_c_library_builds_here():
    assert bindings.load() is not None


@pytest.mark.parametrize("rows, dim", [(1, 256), (64, 256), (2048, 256), (7, 80), (3, 4100)])
def test_rms_norm_with_and_without_the_residual(elementwise, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    normed, summed = elementwise.rms_norm(x, None, weight, 1e-6)
    assert summed is None
    torch.testing.assert_close(normed, hf_rms_norm(x, weight, 1e-6), **TOL)
    normed, summed = elementwise.rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, hf_rms_norm(x + residual, weight, 1e-5), **TOL)


def test_rms_norm_takes_strided_rows_and_falls_back_for_other_shapes(elementwise):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 300, generator=gen)
    weight = torch.randn(64, generator=gen)
    strided = wide[:, 10:74]  # rows 300 floats apart
    torch.testing.assert_close(
        elementwise.rms_norm(strided, None, weight, 1e-6)[0], hf_rms_norm(strided, weight, 1e-6)
    )
    heads = torch.randn(5, 4, 64, generator=gen)  # [T, H, D]: Qwen3's q/k norm, torch path
    torch.testing.assert_close(
        elementwise.rms_norm(heads, None, weight, 1e-6)[0], hf_rms_norm(heads, weight, 1e-6)
    )


@pytest.mark.parametrize("rows, inter", [(1, 768), (64, 768), (2048, 768), (3, 37)])
def test_silu_mul(elementwise, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 8  # both tails of the sigmoid
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(elementwise.silu_mul(gate_up), F.silu(gate) * up, **TOL)


@pytest.mark.parametrize(
    "tokens, heads, dim", [(1, 6, 64), (64, 6, 64), (2048, 6, 64), (3, 5, 128)]
)
def test_rope_is_hugging_faces_rotation_to_the_bit(elementwise, tokens, heads, dim):
    """On a strided view of the fused qkv output, as the attention layer calls it; against
    transformers' q * cos + rotate_half(q) * sin with its [c, c] and [s, s] tables."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=gen)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    c, s = angles.cos(), angles.sin()
    rotated = elementwise.rope(x, torch.cat((c, c), -1)[:, None], torch.cat((-s, s), -1)[:, None])
    assert rotated.is_contiguous()  # as the attention reads q
    half = dim // 2
    rotate_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    hf = x * torch.cat((c, c), -1)[:, None] + rotate_half * torch.cat((s, s), -1)[:, None]
    assert torch.equal(rotated, hf)
    fallback = elementwise.rope(
        x.double(),
        torch.cat((c, c), -1)[:, None].double(),
        torch.cat((-s, s), -1)[:, None].double(),
    )  # torch path
    torch.testing.assert_close(rotated, fallback.float(), **TOL)
