"""The `cpu` attention backend over a bf16 KV cache (kernels/cpu/attention.py): decode steps go to
the C decode kernel (csrc/cpu_decode.c), which widens each K/V element to fp32 and computes as it
does over an fp32 cache -- so its result is the fp32 kernel's over the widened cache, rounded to
q's dtype, bit for bit -- and within bf16 tolerance of the reference backend; steps with prefill
chunks stay on the torch path. store_kv writes bf16 rows into a bf16 cache in C, exactly."""

from __future__ import annotations

import pytest
import torch

from actorserve.kernels import reference
from actorserve.kernels.cpu import attention as cpu
from actorserve.kernels.cpu import bindings
from kernel_support import TOLERANCES, make_batch


@pytest.fixture
def c_calls(monkeypatch) -> list[tuple[str, torch.dtype]]:
    """(rows, cache dtype) of every call into the C attention kernels."""
    calls = []
    real = bindings.paged_attention

    def recording(lib, rows, q, k_cache, *args):
        calls.append((rows, k_cache.dtype))
        return real(lib, rows, q, k_cache, *args)

    monkeypatch.setattr(bindings, "paged_attention", recording)
    return calls


def widened(batch):
    """The batch's arguments with q and the caches in fp32."""
    q, k, v, *meta = batch.args()
    return (q.float(), k.float(), v.float(), *meta)


@pytest.mark.parametrize("head_dim", [64, 72, 128])  # 72: not whole 16-float vectors
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_bf16_cache_decodes_are_the_fp32_kernel_over_the_widened_cache(
    c_calls, head_dim, heads, block_size
):
    batch = make_batch(
        [1] * 5, [1, 9, 40, 77, 130], dtype=torch.bfloat16, head_dim=head_dim,
        num_q_heads=heads[0], num_kv_heads=heads[1], block_size=block_size,
    )  # fmt: skip
    attention = cpu.CpuAttention()
    got = attention.paged_attention(*batch.args())
    assert c_calls == [("decode", torch.bfloat16)]
    assert got.dtype == torch.bfloat16
    fp32 = attention.paged_attention(*widened(batch))
    assert torch.equal(got, fp32.to(torch.bfloat16))
    torch.testing.assert_close(
        got, reference.paged_attention(*batch.args()), **TOLERANCES[torch.bfloat16]
    )


def test_fp32_queries_over_a_bf16_cache_decode_in_c_in_fp32(c_calls):
    batch = make_batch([1] * 3, [5, 33, 64], dtype=torch.bfloat16)
    q, k, v, *meta = batch.args()
    attention = cpu.CpuAttention()
    got = attention.paged_attention(q.float(), k, v, *meta)
    assert c_calls == [("decode", torch.bfloat16)] and got.dtype == torch.float32
    assert torch.equal(got, attention.paged_attention(*widened(batch)))


def test_bf16_cache_steps_with_prefill_chunks_take_the_torch_path(c_calls):
    batch = make_batch([1, 20, 1, 7], [50, 20, 9, 30], dtype=torch.bfloat16)
    got = cpu.CpuAttention().paged_attention(*batch.args())
    assert c_calls == []
    torch.testing.assert_close(
        got, reference.paged_attention(*batch.args()), **TOLERANCES[torch.bfloat16]
    )


def test_store_kv_writes_bf16_rows_into_a_bf16_cache_in_c(monkeypatch):
    torch.manual_seed(0)
    qkv = torch.randn(6, 3, 4, 8).bfloat16()  # rows of a fused projection: k and v are strided
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, -1, 17, 0, 30, 9])
    expected = [torch.randn(4, 8, 4, 8).bfloat16() for _ in range(2)]
    got = [t.clone() for t in expected]
    reference.store_kv(k, v, *expected, slots)
    called = []
    real = bindings.store_kv
    monkeypatch.setattr(bindings, "store_kv", lambda *a: called.append(1) or real(*a))
    cpu.store_kv(k, v, *got, slots)
    assert called and all(torch.equal(a, b) for a, b in zip(got, expected))
