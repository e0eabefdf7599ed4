"""The CPU bundle's elementwise steps on bf16 tensors (kernels/cpu/csrc/cpu_elementwise_bf16.c via
kernels/cpu/elementwise.py) give kernels/elementwise.py's torch results in bf16 to the bit: each
rounds to bf16 where torch does, RMSNorm's sum of squares is added in torch's order, and
bf16(silu(g)) is torch's for every one of the 65536 bf16 gates. So on each vector width this CPU
can run (the library built for it, and an AVX2 build where it has AVX-512), for rows whose
width is not a multiple of a vector, and with NaN and infinities among the inputs (a NaN's bits
aside: torch itself writes 0x7fc0 or 0xffff). A bf16 model built with them gives the logits
it gives with the torch steps, to the bit."""

from __future__ import annotations

import pytest
import torch

from actorserve.actors.worker.loader import load_model
from actorserve.kernels import attention_ops, elementwise
from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE
from actorserve.kernels.elementwise import TORCH_ELEMENTWISE
from actorserve.weights.checkpoints import ensure_checkpoint
from kernel_support import MARCHES
from model_support import PagedCache, random_prompt

BF16 = torch.bfloat16
SHAPES = [(n, d) for n in (1, 7, 300) for d in (64, 128, 1000, 2816)]


@pytest.fixture(scope="module", params=MARCHES)
def lib(request):
    lib = bindings.load(request.param)
    assert lib is not None, f"the CPU kernels could not be built for {request.param}"
    return lib


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal dtype, shape and bits, a NaN matching any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def every_bf16() -> torch.Tensor:
    """All 65536 bf16 values (NaNs and infinities among them)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16)


def rope_tables(tokens: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos [c, c] and sin [-s, s] [T, 1, D] in bf16, as RotaryEmbedding gives a bf16 model."""
    angles = torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(seed)) * 100
    c, s = angles.cos(), angles.sin()
    return torch.cat((c, c), -1)[:, None].to(BF16), torch.cat((-s, s), -1)[:, None].to(BF16)


@pytest.mark.parametrize("rows, dim", SHAPES + [(3, 5), (2, 100_000)])
def test_rms_norm_is_torchs_to_the_bit_with_and_without_the_residual(lib, rows, dim):
    """(3, 5): shorter than torch's sum vector; 100 000: every level of its cascade sum."""
    x, residual = randn(rows, dim, seed=dim), randn(rows, dim, seed=dim + 1, scale=3)
    weight = randn(dim, seed=dim + 2)
    normed, summed = bindings.rms_norm(lib, x, None, weight, 1e-6)
    want, _ = elementwise.rms_norm(x, None, weight, 1e-6)
    assert summed is None
    assert_same_bits(normed, want)
    normed, summed = bindings.rms_norm(lib, x, residual, weight, 1e-5)
    want, want_summed = elementwise.rms_norm(x, residual, weight, 1e-5)
    assert_same_bits(summed, want_summed)
    assert_same_bits(normed, want)


def test_rms_norm_adds_its_squares_in_torchs_order(lib):
    """At a prefill's size another order of the fp32 sum of squares (here the exact sum, rounded
    once) moves some normalized values across a bf16 rounding boundary; torch's order moves
    none."""
    x, weight = randn(2048, 2816, seed=1), torch.ones(2816, dtype=BF16)
    want, _ = elementwise.rms_norm(x, None, weight, 1e-5)
    h = x.float()
    exact_sum = h.double().pow(2).sum(-1, keepdim=True).float()
    other_order = (h * torch.rsqrt(exact_sum / 2816 + 1e-5)).to(BF16)
    assert (other_order != want).any()
    assert_same_bits(bindings.rms_norm(lib, x, None, weight, 1e-5)[0], want)


def test_rms_norm_takes_strided_rows(lib):
    wide = randn(5, 300, seed=0)
    strided, weight = wide[:, 10:74], randn(64, seed=1)  # rows 300 elements apart
    want, _ = elementwise.rms_norm(strided, None, weight, 1e-6)
    assert_same_bits(bindings.rms_norm(lib, strided, None, weight, 1e-6)[0], want)


@pytest.mark.parametrize("rows, inter", SHAPES)
def test_silu_mul_is_torchs_to_the_bit(lib, rows, inter):
    gate_up = randn(rows, 2 * inter, seed=inter, scale=4)  # both tails of the sigmoid
    assert_same_bits(bindings.silu_mul(lib, gate_up), elementwise.silu_mul(gate_up))


@pytest.mark.parametrize("inter, column", [(64, 0), (64, 63), (33, 32), (7, 3)])
def test_silu_of_every_bf16_gate_is_torchs(lib, inter, column):
    """Every bf16 gate (times up = 1, which keeps silu's own rounding) in one column: inside
    torch's vectors (where it takes Sleef's exp) or past them (glibc's expf), and inside or
    past the kernel's; the C exp may differ from both in fp32, never after rounding to bf16."""
    gates = every_bf16()
    gate_up = randn(len(gates), 2 * inter, seed=inter)
    gate_up[:, column], gate_up[:, inter + column] = gates, 1.0
    got, want = bindings.silu_mul(lib, gate_up), elementwise.silu_mul(gate_up)
    assert_same_bits(got[:, column], want[:, column])
    assert_same_bits(got, want)
    assert got[:, column].isnan().sum() == gates.isnan().sum() + 1  # silu(-inf) is NaN too


@pytest.mark.parametrize("tokens, heads, dim", [(1, 16, 64), (300, 24, 64), (7, 3, 128),
                                                (5, 2, 1000), (3, 2, 6)])  # fmt: skip
def test_rope_is_torchs_to_the_bit_on_a_view_of_qkv(lib, tokens, heads, dim):
    qkv = randn(tokens, (heads + 2) * dim, seed=tokens)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos, sin = rope_tables(tokens, dim, seed=dim)
    rotated = bindings.rope(lib, x, cos.squeeze(1), sin.squeeze(1))
    assert rotated.is_contiguous()
    assert_same_bits(rotated, elementwise.rope(x, cos, sin))


def nan_and_infinities(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with a NaN, an inf and a -inf at random places of each of its first rows."""
    gen = torch.Generator().manual_seed(seed)
    x = x.clone()
    for row, value in enumerate((float("nan"), float("inf"), float("-inf"))):
        x.view(-1, x.shape[-1])[row, torch.randint(x.shape[-1], (1,), generator=gen)] = value
    return x


def test_nan_and_infinities_come_out_as_torchs(lib):
    x, residual = nan_and_infinities(randn(6, 1000, seed=0), 1), randn(6, 1000, seed=2)
    weight = nan_and_infinities(randn(3, 1000, seed=3), 4)[2]  # a -inf in the weight
    for res in (None, residual, nan_and_infinities(residual, 5)):
        got, got_summed = bindings.rms_norm(lib, x, res, weight, 1e-6)
        want, want_summed = elementwise.rms_norm(x, res, weight, 1e-6)
        assert_same_bits(got, want)
        if res is not None:
            assert_same_bits(got_summed, want_summed)
    gate_up = nan_and_infinities(randn(6, 2 * 1000, seed=6, scale=4), 7)
    gate_up[3:] = nan_and_infinities(gate_up[3:].flip(-1), 8)  # in up too
    assert_same_bits(bindings.silu_mul(lib, gate_up), elementwise.silu_mul(gate_up))
    x = nan_and_infinities(randn(4, 3, 64, seed=9), 10)
    cos, sin = rope_tables(4, 64, seed=11)
    assert_same_bits(bindings.rope(lib, x, cos.squeeze(1), sin.squeeze(1)),
                     elementwise.rope(x, cos, sin))  # fmt: skip


def test_the_cpu_bundle_serves_bf16_from_c(monkeypatch):
    """bf16 tensors the C path takes never reach the torch functions; those it does not (an
    fp32 weight, whose product torch promotes to fp32; fp32 rope tables) still get torch's."""

    def no_torch(*args):
        raise AssertionError("took the torch path")

    x, residual, weight = randn(7, 128, seed=0), randn(7, 128, seed=1), randn(128, seed=2)
    cos, sin = rope_tables(7, 64, seed=3)
    qkv = randn(7, 4 * 64, seed=4)
    q, k, _ = elementwise.split_qkv(qkv, 2, 1)
    wants = (
        elementwise.rms_norm(x, residual, weight, 1e-6),
        elementwise.silu_mul(x),
        TORCH_ELEMENTWISE.qk_norm_rope(qkv, 2, 1, cos, sin, None, None, 1e-6),
    )
    with monkeypatch.context() as patch:
        for name in ("rms_norm", "silu_mul", "rope"):
            patch.setattr(elementwise, name, no_torch)
        normed, summed = C_ELEMENTWISE.rms_norm(x, residual, weight, 1e-6)
        act = C_ELEMENTWISE.silu_mul(x)
        rotated = C_ELEMENTWISE.qk_norm_rope(qkv, 2, 1, cos, sin, None, None, 1e-6)
    for got, want in zip((normed, summed, act, *rotated), (*wants[0], wants[1], *wants[2])):
        assert_same_bits(got, want)
    fp32_weight = weight.float()
    got, _ = C_ELEMENTWISE.rms_norm(x, None, fp32_weight, 1e-6)
    assert got.dtype == torch.float32
    assert torch.equal(got, elementwise.rms_norm(x, None, fp32_weight, 1e-6)[0])
    got = C_ELEMENTWISE.rope(q, cos.float(), sin.float())
    assert got.dtype == torch.float32
    assert torch.equal(got, elementwise.rope(q, cos.float(), sin.float()))
    assert_same_bits(C_ELEMENTWISE.rope(k, cos, sin), elementwise.rope(k, cos, sin))


@pytest.mark.parametrize("kind", ["demo-bf16", "tiny-qwen3-bf16"])
def test_a_bf16_model_gives_the_same_logits_with_the_c_steps(kind):
    """A prefill of two prompts, then two decode steps, through a bf16 model built with the CPU
    bundle and one built with the torch bundle (the rest plain torch on both)."""
    path, steps = ensure_checkpoint(kind), []
    for ops in (C_ELEMENTWISE, TORCH_ELEMENTWISE):
        model, config = load_model(path, "cpu", BF16, attention_ops("cpu"), ops)
        cache = PagedCache(model, config)
        cache.kv = [(k.to(BF16), v.to(BF16)) for k, v in cache.kv]
        prompts = {"a": random_prompt(37, seed=0), "b": random_prompt(5, seed=1)}
        logits = [cache.step(prompts)]
        for _ in range(2):
            logits.append(cache.step({seq: [int(x[-1].argmax())] for seq, x in logits[-1].items()}))
        steps.append(logits)
    for c_step, torch_step in zip(*steps, strict=True):
        for seq in c_step:
            assert torch.equal(c_step[seq], torch_step[seq])
