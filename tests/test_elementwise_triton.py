"""The fused Triton elementwise kernels (kernels/elementwise_triton.py) against the torch ops they
replace, in the interpreter on CPU (conftest sets TRITON_INTERPRET=1) and on CUDA where there is
one: fp32, bf16 and fp16, sizes that are not powers of two, the q/k norm + rope step Qwen3-shaped
(with the norm) and Llama-shaped (without); and a model whose elementwise steps are all Triton's
gives the torch model's greedy tokens.

Tolerances: the kernels round where torch rounds, so what differs is the order of the norm's fp32
sum (and the last bit of exp / rsqrt): fp32 within 2e-6; half precision within two units in the
last place of the output (2^-6 relative for bf16, 2^-9 for fp16), plus that much of the operands'
scale where rope adds two rounded products. Rope without a norm and the residual sum are exact,
except in bf16 under the interpreter: its casts to bf16 truncate (triton/runtime/interpreter.py)
where the GPU and torch round to nearest even.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actorserve.actors.worker.loader import load_model
from actorserve.kernels import attention_ops, elementwise_ops
from actorserve.kernels.elementwise import TORCH_ELEMENTWISE
from actorserve.kernels.elementwise_triton import TRITON_ELEMENTWISE
from kernel_support import DEVICE
from model_support import PagedCache, random_prompt, torch_threads

# the interpreter's numpy warns where exp(-gate) overflows to inf: silu is then -0, as torch's
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}
TORCH, TRITON = TORCH_ELEMENTWISE, TRITON_ELEMENTWISE


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
    """Within two units in the last place of want (of `scale`, where a sum of rounded terms
    may cancel)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = ULP[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def assert_exact(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
    """Equal to the bit where the Triton casts round as torch's do (see the module docstring)."""
    if want.dtype == torch.bfloat16 and DEVICE == "cpu":
        assert_within_ulp(got, want, scale)
    else:
        assert got.dtype == want.dtype and torch.equal(got, want)


# --- residual add + RMSNorm ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, dim", [(1, 128), (7, 80), (5, 1000), (33, 16)])
def test_add_rms_norm_matches_torch(dtype, rows, dim):
    x, residual = randn(rows, dim, seed=1, dtype=dtype), randn(rows, dim, seed=2, dtype=dtype)
    weight = randn(dim, seed=3, dtype=dtype)
    normed, summed = TRITON.rms_norm(x, residual, weight, 1e-6)
    want_normed, want_summed = TORCH.rms_norm(x, residual, weight, 1e-6)
    assert_exact(summed, want_summed)  # the new residual: x + residual rounded once
    assert_within_ulp(normed, want_normed)
    normed, summed = TRITON.rms_norm(x, None, weight, 1e-5)
    assert summed is None
    assert_within_ulp(normed, TORCH.rms_norm(x, None, weight, 1e-5)[0])


def test_add_rms_norm_leaves_its_inputs_alone_and_takes_strided_rows():
    wide = randn(6, 300, seed=4)
    x, residual = wide[:, 10:138], randn(6, 128, seed=5)
    before = (x.clone(), residual.clone())
    weight = randn(128, seed=6)
    normed, summed = TRITON.rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
    assert normed.is_contiguous() and summed.is_contiguous()
    assert_within_ulp(normed, TORCH.rms_norm(x, residual, weight, 1e-6)[0])


def test_rms_norm_outside_the_kernels_reach_is_torchs():
    """float64, or a weight of another dtype than x: the torch op itself, to the bit."""
    x, weight = randn(3, 64, seed=7, dtype=torch.float64), randn(64, seed=8, dtype=torch.float64)
    assert torch.equal(
        TRITON.rms_norm(x, x, weight, 1e-6)[0], TORCH.rms_norm(x, x, weight, 1e-6)[0]
    )
    half = x.to(torch.bfloat16)
    assert torch.equal(
        TRITON.rms_norm(half, None, weight.float(), 1e-6)[0],
        TORCH.rms_norm(half, None, weight.float(), 1e-6)[0],
    )


# --- SiLU x up ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", [(1, 64), (4, 37), (3, 1500)])  # 1500: two column blocks
def test_silu_mul_matches_torch(dtype, rows, inter):
    gate_up = randn(rows, 2 * inter, seed=inter, dtype=dtype) * 8  # both tails of the sigmoid
    got = TRITON.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert got.is_contiguous()
    assert_within_ulp(got, F.silu(gate) * up)


# --- q/k norm + rope ----------------------------------------------------------------------------


def rope_tables(tokens: int, head_dim: int, dtype: torch.dtype, seed: int):
    """cos, sin [T, 1, D] laid out as RotaryEmbedding gives them: [c, c] and [-s, s]."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    c, s = angles.cos(), angles.sin()
    tables = torch.cat((c, c), -1)[:, None], torch.cat((-s, s), -1)[:, None]
    return tuple(t.to(dtype).to(DEVICE) for t in tables)


SHAPES = {  # (Hq, Hkv, D, q/k norm)
    "qwen3": (16, 8, 128, True),
    "llama": (6, 2, 64, False),
    "odd-qwen3": (6, 3, 80, True),  # head_dim and head counts not powers of two
    "odd-llama": (5, 1, 96, False),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_qk_norm_rope_matches_torch(dtype, shape):
    heads, kv_heads, head_dim, qk_norm = SHAPES[shape]
    tokens = 5
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=9, dtype=dtype) * 3
    cos, sin = rope_tables(tokens, head_dim, dtype, seed=10)
    norm = (randn(head_dim, seed=11, dtype=dtype), randn(head_dim, seed=12, dtype=dtype), 1e-6)
    if not qk_norm:
        norm = (None, None, 0.0)
    q, k, v = TRITON.qk_norm_rope(qkv, heads, kv_heads, cos, sin, *norm)
    want_q, want_k, want_v = TORCH.qk_norm_rope(qkv, heads, kv_heads, cos, sin, *norm)
    assert q.shape == (tokens, heads, head_dim) and k.shape == (tokens, kv_heads, head_dim)
    assert q.is_contiguous() and k.is_contiguous()  # as paged attention and the CPU path read
    assert v.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # a view
    assert torch.equal(v, want_v)
    for got, want in ((q, want_q), (k, want_k)):
        scale = float(want.abs().max())  # x * cos and x' * sin are of its size
        if qk_norm:
            assert_within_ulp(got, want, scale)
        else:  # two rounded products and a rounded sum: torch's rounding, to the bit
            assert_exact(got, want, scale)


def test_rope_alone_is_torchs_to_the_bit_on_a_strided_view():
    qkv = randn(4, 10 * 64, seed=13, dtype=torch.float16)
    x = qkv[:, 64 : 7 * 64].view(4, 6, 64)  # rows 640 apart, as the fused projection lays q out
    cos, sin = rope_tables(4, 64, torch.float16, seed=14)
    got = TRITON.rope(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, TORCH.rope(x, cos, sin))


def test_triton_bundle_goes_with_the_triton_attention_backend():
    assert elementwise_ops(attention_ops("cpu", "triton")) is TRITON_ELEMENTWISE
    assert elementwise_ops(attention_ops("cpu", "reference")) is TORCH_ELEMENTWISE
    assert elementwise_ops(attention_ops("cpu", "cpu", c_kernels=False)) is TORCH_ELEMENTWISE


# --- the whole model ----------------------------------------------------------------------------


def greedy_run(model, config, steps: int) -> tuple[dict[str, list[int]], torch.Tensor]:
    """Two sequences: a prefilled in two chunks while b decodes, then both decode greedily;
    -> ({seq: greedy tokens}, every step's logits)."""
    cache = PagedCache(model, config, seed=2, device=DEVICE)
    prompts = {"a": random_prompt(19, 6), "b": random_prompt(7, 7)}
    logits = [cache.step({"a": prompts["a"][:9], "b": prompts["b"]})]
    tokens = {"a": [], "b": [int(logits[-1]["b"][-1].argmax())]}
    logits.append(cache.step({"a": prompts["a"][9:], "b": tokens["b"][-1:]}))
    for _ in range(steps):
        for seq in tokens:
            tokens[seq].append(int(logits[-1][seq][-1].argmax()))
        logits.append(cache.step({seq: ids[-1:] for seq, ids in tokens.items()}))
    return tokens, torch.cat([t for step in logits for t in step.values()])


@pytest.mark.parametrize("kind", ["tiny-qwen3", "tiny-llama"])
def test_model_with_triton_elementwise_gives_torchs_greedy_tokens(kind):
    """Attention is the reference's in both, so the elementwise steps are all that differ."""
    from actorserve.weights.checkpoints import ensure_checkpoint

    path = ensure_checkpoint(kind)
    ops = attention_ops(DEVICE, "reference")
    with torch_threads(1):
        runs = [
            greedy_run(*load_model(path, DEVICE, torch.float32, ops, bundle), steps=5)
            for bundle in (TORCH_ELEMENTWISE, TRITON_ELEMENTWISE)
        ]
    (want_tokens, want_logits), (tokens, logits) = runs
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_model_as_the_worker_builds_it_on_cuda_matches_transformers():
    """Triton attention and Triton elementwise steps together (elementwise_ops' choice), on
    tiny-qwen3 (q/k norm), against transformers: the chunked-prefill-then-decode schedule of
    tests/test_model.py, logits within its tolerance and the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    from actorserve.weights.checkpoints import ensure_checkpoint
    from model_support import check_chunked_prefill_then_decode

    path = ensure_checkpoint("tiny-qwen3")
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ops = attention_ops(DEVICE, "triton")
    with torch_threads(1):
        ours, config = load_model(path, DEVICE, torch.float32, ops, elementwise_ops(ops))
        assert ours.elementwise is TRITON_ELEMENTWISE
        check_chunked_prefill_then_decode(hf, ours, config, DEVICE)
