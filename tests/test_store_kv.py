"""The Triton KV store (kernels/store_kv.py) against the torch reference: rows written at their
slots, -1 skipped, nothing written outside the cache, bad arguments refused by name; then the
attention sees the new tokens. On CPU it runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from actorserve.kernels import reference
from actorserve.kernels.store_kv import store_kv
from kernel_support import DEVICE, assert_matches_reference, gpu_test, make_batch


def _caches(num_blocks=6, block_size=8, num_kv_heads=2, head_dim=80, dtype=torch.float32):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape).to(dtype).to(DEVICE), torch.randn(shape).to(dtype).to(DEVICE))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_store_kv_writes_rows_at_slots_and_skips_minus_one(cache_dtype):
    torch.manual_seed(0)
    k_cache, v_cache = _caches(dtype=cache_dtype)
    k = torch.randn(5, 2, 80, device=DEVICE)
    v = torch.randn(5, 2, 80, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 47, -1], device=DEVICE)  # 47 = last slot of block 5
    before_k, before_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)

    expected_k, expected_v = before_k.clone(), before_v.clone()
    reference.store_kv(k, v, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache[2, 1], k[2].to(cache_dtype))  # slot 17 = block 2, offset 1
    flat_k = k_cache.view(-1, 2, 80)
    untouched = [s for s in range(48) if s not in (3, 17, 47)]
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 80)[untouched])


def test_store_kv_never_writes_outside_the_cache():
    """Caches are views into a buffer with a guard block on each side; slots -1 and
    num_blocks * block_size (one past the end) are skipped, so the guards stay intact."""
    k_buffer, v_buffer = _caches(num_blocks=8)
    k_cache, v_cache = k_buffer[1:-1], v_buffer[1:-1]  # 6 blocks of 8 = slots 0..47
    guards = k_buffer[[0, -1]].clone(), v_buffer[[0, -1]].clone()
    k = torch.randn(4, 2, 80, device=DEVICE)
    store_kv(k, k, k_cache, v_cache, torch.tensor([-1, 48, 0, -1], device=DEVICE))
    assert torch.equal(k_buffer[[0, -1]], guards[0]) and torch.equal(v_buffer[[0, -1]], guards[1])
    assert torch.equal(k_cache[0, 0], k[2]) and torch.equal(v_cache[0, 0], k[2])


def test_store_kv_with_int32_slots_then_attention_sees_the_new_tokens():
    batch = make_batch([4, 1], [12, 21], block_size=8, num_q_heads=4, num_kv_heads=2)
    gen = torch.Generator().manual_seed(5)
    k_new = torch.randn(5, 2, 64, generator=gen).to(DEVICE)
    v_new = torch.randn(5, 2, 64, generator=gen).to(DEVICE)
    slots = []
    for b, (q_len, seq_len) in enumerate([(4, 12), (1, 21)]):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(batch.block_tables[b, pos // 8]) * 8 + pos % 8)
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    store_kv(k_new, v_new, batch.k_cache, batch.v_cache, slot_mapping)
    block, offset = divmod(slots[-1], 8)
    assert torch.equal(batch.k_cache[block, offset], k_new[-1])
    assert_matches_reference(batch)


BAD_STORE_ARGS = [
    (
        "k heads",
        lambda k, v, kc, vc, s: (k[:, :1], v[:, :1], kc, vc, s),
        r"k must be \[T, Hkv, D\] = \[T, 2, 80\]",
    ),
    ("v shape", lambda k, v, kc, vc, s: (k, v[:2], kc, vc, s), "v shape .* must equal k shape"),
    (
        "float slots",
        lambda k, v, kc, vc, s: (k, v, kc, vc, s.float()),
        "slot_mapping must be int32 or int64",
    ),
    (
        "slot count",
        lambda k, v, kc, vc, s: (k, v, kc, vc, s[:2]),
        r"slot_mapping must be .* of shape \[T\]=\(3,\)",
    ),
    (
        "cache dtype",
        lambda k, v, kc, vc, s: (k, v, kc.int(), vc.int(), s),
        "k_cache dtype must be float16, bfloat16 or float32",
    ),
    ("cache pair", lambda k, v, kc, vc, s: (k, v, kc, vc[:, :4], s), "v_cache shape .* must equal"),
    ("int k", lambda k, v, kc, vc, s: (k.int(), v, kc, vc, s), "k must be a floating tensor"),
]


@pytest.mark.parametrize("name, mutate, message", BAD_STORE_ARGS, ids=lambda x: None)
def test_store_kv_rejects_bad_arguments(name, mutate, message):
    k_cache, v_cache = _caches()
    k = torch.randn(3, 2, 80, device=DEVICE)
    args = (k, k.clone(), k_cache, v_cache, torch.tensor([0, 1, -1], device=DEVICE))
    with pytest.raises(ValueError, match=message):
        store_kv(*mutate(*args))


@gpu_test
def test_gpu_store_kv_bf16():
    k_cache, v_cache = _caches(
        num_blocks=512, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16
    )
    k = torch.randn(1000, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.randperm(512 * 16, device=DEVICE)[:1000]
    slots[::7] = -1
    expected = k_cache.clone(), v_cache.clone()
    store_kv(k, k, k_cache, v_cache, slots)
    reference.store_kv(k, k, *expected, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
