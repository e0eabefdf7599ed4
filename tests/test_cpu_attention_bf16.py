"""The `cpu` attention backend over a bf16 KV cache (kernels/cpu/attention.py): decode steps go to
the C kernel for a bf16 cache (csrc/cpu_decode_bf16.c), which rounds q to bf16 and computes in
fp32 -- so its result is fp32 attention of the rounded q over the widened cache, up to fp32
rounding (another order of the sums, the softmax online) -- and within bf16 tolerance of the
reference backend; a sequence's result does not depend on the batch around it (how the work is
split); steps with prefill chunks stay on the torch path. store_kv writes bf16 rows into a bf16
cache in C, exactly."""

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


def rounded_q_over_widened_cache(q, k, v, *meta):
    """The reference in fp32 on the kernel's inputs: q rounded to bf16, the caches widened."""
    return reference.paged_attention(q.bfloat16().float(), k.float(), v.float(), *meta)


@pytest.mark.parametrize("head_dim", [64, 72, 128, 32])  # 72, 32: not whole vectors of pairs
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 2), (16, 2), (32, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_cache_decodes_are_fp32_attention_of_q_rounded_to_bf16(
    c_calls, head_dim, heads, block_size
):
    batch = make_batch(
        [1] * 5, [1, 9, 40, 77, 130], dtype=torch.bfloat16, head_dim=head_dim,
        num_q_heads=heads[0], num_kv_heads=heads[1], block_size=block_size,
    )  # fmt: skip
    q, k, v, *meta = batch.args()
    got = cpu.CpuAttention().paged_attention(q.float(), k, v, *meta)
    assert c_calls == [("decode", torch.bfloat16)] and got.dtype == torch.float32
    expected = rounded_q_over_widened_cache(q.float(), k, v, *meta)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("heads", [(4, 4), (16, 8)])
def test_bf16_queries_get_bf16_out_within_bf16_tolerance_of_the_reference(c_calls, heads):
    batch = make_batch(
        [1] * 4, [3, 16, 50, 200], dtype=torch.bfloat16, num_q_heads=heads[0],
        num_kv_heads=heads[1],
    )  # fmt: skip
    got = cpu.CpuAttention().paged_attention(*batch.args())
    assert c_calls == [("decode", torch.bfloat16)] and got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got, reference.paged_attention(*batch.args()), **TOLERANCES[torch.bfloat16]
    )


def test_a_maximum_that_rises_late_in_the_context_rescales_what_came_before():
    """Keys grow along the context, so each block's scores top the earlier ones: the online
    softmax rescales its sums and outputs at every block and must land on the exact answer."""
    batch = make_batch([1] * 2, [200, 333], dtype=torch.bfloat16, num_q_heads=8, num_kv_heads=4)
    q, k, v, *meta = batch.args()
    q = q.float().abs()
    growth = torch.linspace(0.1, 4.0, k.shape[0] * k.shape[1]).view(k.shape[0], k.shape[1], 1, 1)
    order = torch.empty_like(growth)  # the growth in context order, through the block tables
    blocks = [int(b) for row, n in zip(batch.block_tables, meta[1]) for b in row[: -(-n // 16)]]
    order[blocks] = growth[: len(blocks)]
    k = (k.float().abs() * order).bfloat16()
    got = cpu.CpuAttention().paged_attention(q, k, v, *meta)
    expected = rounded_q_over_widened_cache(q, k, v, *meta)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


def test_a_sequence_gets_the_same_result_alone_and_in_a_large_batch():
    """Alone, the sequence's KV heads are shared out among the threads; among many, whole
    sequences are: the same sums either way."""
    batch = make_batch([1] * 24, [40 + 13 * i for i in range(24)], dtype=torch.bfloat16)
    q, k, v, tables, lens, starts, scale = batch.args()
    attention = cpu.CpuAttention()
    together = attention.paged_attention(q.float(), k, v, tables, lens, starts, scale)
    for i in (0, 11, 23):
        one = torch.tensor([0, 1], dtype=torch.int32)
        alone = attention.paged_attention(
            q[i : i + 1].float(), k, v, tables[i : i + 1], lens[i : i + 1], one, scale
        )
        assert torch.equal(alone[0], together[i])


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
