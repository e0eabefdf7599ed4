"""The bounded set of paged-attention kernel variants (kernels/attention_config.py) and the
warm-up that compiles them all (kernels/paged_attention.warm_up): the split choice never leaves
SPLIT_COUNTS, every tiling serving picks is one warm_up launches, and, on a GPU, serving after the
warm-up compiles nothing. Also the per-signature launch plans of the Triton wrappers."""

from __future__ import annotations

import random

import pytest
import torch
import triton

from actorserve.kernels import paged_attention as attention
from actorserve.kernels import store_kv as store
from actorserve.kernels.attention_config import (
    SPLIT_COUNTS,
    LaunchConfig,
    choose_config,
    num_kv_splits,
    reachable_configs,
)
from kernel_support import DEVICE, assert_matches_reference, gpu_test, make_batch

H200_SMS = 132

# --- the split choice -------------------------------------------------------------------------


@pytest.mark.parametrize("num_seqs, num_kv_heads", [(1, 1), (1, 8), (3, 2), (64, 8), (256, 8)])
def test_split_count_is_always_one_of_the_compiled_set(num_seqs, num_kv_heads):
    """Every context 1..1<<17, at the H200's SM count and with no SMs (CPU): a count from
    SPLIT_COUNTS, and never more splits than the context has tiles."""
    for tile_n in (64, 32):
        for sms in (H200_SMS, 0):
            for context in range(1, (1 << 17) + 1, 1 if tile_n == 64 and sms else 97):
                splits = num_kv_splits(context, num_seqs, num_kv_heads, sms, tile_n)
                assert splits in SPLIT_COUNTS
                assert splits <= max(1, triton.cdiv(context, tile_n))


def test_split_count_fills_the_gpu_from_few_long_decodes():
    assert num_kv_splits(4096, 1, 8, H200_SMS, 64) == 16  # 8 programs, 528 wanted: the most
    assert num_kv_splits(4096, 16, 8, H200_SMS, 64) == 4  # 128 programs: 5 wanted, round down
    assert num_kv_splits(4096, 66, 8, H200_SMS, 64) == 1  # 528 programs fill it already
    assert num_kv_splits(100, 1, 8, H200_SMS, 64) == 2  # only two tiles to share out
    assert num_kv_splits(4096, 1, 8, 0, 64) == 1  # no SMs: never split


SHAPES = [  # (Hq, Hkv, head_dim)
    (16, 8, 128),  # Qwen3-0.6B
    (32, 8, 128),  # Llama-3-8B
    (14, 2, 64),  # Qwen2-0.5B
    (8, 8, 256),  # Gemma-like head_dim above 128
    (6, 2, 80),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_every_tiling_serving_picks_is_one_warm_up_compiles(dtype, heads, kv_heads, head_dim):
    """Random steps (decodes of any batch and context, prefill chunks, mixed batches) at the
    H200's SM count: choose_config lands in reachable_configs every time."""
    reachable = set(reachable_configs(dtype, head_dim, heads // kv_heads))
    rng = random.Random(heads * head_dim)
    picked = set()
    for _ in range(3000):
        num_seqs = rng.choice([rng.randrange(1, 9), rng.randrange(1, 513)])
        num_tokens = rng.choice([num_seqs, num_seqs + rng.randrange(1, 8192)])
        max_blocks = rng.randrange(1, 8193)
        q = torch.empty((num_tokens, heads, head_dim), dtype=dtype, device="meta")
        cache = torch.empty((1, 16, kv_heads, head_dim), dtype=dtype, device="meta")
        tables = torch.empty((num_seqs, max_blocks), dtype=torch.int32, device="meta")
        picked.add(choose_config(q, cache, tables, num_sms=H200_SMS))
    assert picked <= reachable
    assert len(picked) == len(reachable)  # and each of them is reachable


def test_reachable_configs_per_model():
    """Decode at each split count; prefill with 64- and 128-row query blocks (64 only above
    head_dim 128); fp32 has one tiling for both."""
    assert len(reachable_configs(torch.bfloat16, 128, 2)) == len(SPLIT_COUNTS) + 2
    assert len(reachable_configs(torch.bfloat16, 256, 1)) == len(SPLIT_COUNTS) + 1
    assert len(reachable_configs(torch.float32, 64, 2)) == len(SPLIT_COUNTS)


# --- the warm-up --------------------------------------------------------------------------------


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: records each launch's tiling, then launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launched = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize(
    "dtype, head_dim, expected",
    [
        # 5 split counts + 2 prefill tilings, 4 combine kernels, the store
        (torch.float16, 64, 5 + 2 + 4 + 1),
        # one tiling for decode and prefill: 5 split counts, 4 combine kernels, the store
        (torch.float32, 64, 5 + 4 + 1),
    ],
    ids=["fp16", "fp32"],
)
def test_warm_up_launches_every_reachable_variant(monkeypatch, dtype, head_dim, expected):
    recorders = {
        name: LaunchRecorder(getattr(attention, name))
        for name in ("_paged_attention_kernel", "_combine_splits_kernel")
    }
    for name, recorder in recorders.items():
        monkeypatch.setattr(attention, name, recorder)
    stores = LaunchRecorder(store._store_kv_kernel)
    monkeypatch.setattr(store, "_store_kv_kernel", stores)

    assert attention.warm_up(4, 2, head_dim, 16, dtype, DEVICE) == expected
    launched = {
        LaunchConfig(c["BLOCK_M"], c["TILE_N"], c["NUM_SPLITS"], c["num_warps"], c["num_stages"])
        for c in recorders["_paged_attention_kernel"].launched
    }
    assert launched == set(reachable_configs(dtype, head_dim, 2))
    combined = {c["NUM_SPLITS"] for c in recorders["_combine_splits_kernel"].launched}
    assert combined == set(SPLIT_COUNTS) - {1}
    assert len(stores.launched) == 1


def test_worker_warm_up_covers_attention_store_and_elementwise_kernels(monkeypatch):
    """What the Worker runs at start on CUDA, here under the interpreter for tiny-qwen3 (fp32):
    the attention variants as above, and RMSNorm with and without the residual, SiLU x up and
    the q/k norm + rope, each launched once."""
    from actorserve.actors.runtime.model_config import ModelConfig
    from actorserve.kernels import elementwise_triton
    from actorserve.kernels.triton_warm_up import warm_up_triton
    from actorserve.weights.checkpoints import ensure_checkpoint

    names = ("_rms_norm_kernel", "_silu_mul_kernel", "_qk_norm_rope_kernel")
    recorders = {name: LaunchRecorder(getattr(elementwise_triton, name)) for name in names}
    for name, recorder in recorders.items():
        monkeypatch.setattr(elementwise_triton, name, recorder)
    config = ModelConfig.from_dir(ensure_checkpoint("tiny-qwen3"))
    assert warm_up_triton(config, 16, torch.float32, DEVICE) == (5 + 4 + 1) + 4
    norms = recorders["_rms_norm_kernel"].launched
    assert sorted(c["HAS_RESIDUAL"] for c in norms) == [False, True]
    assert [c["HAS_NORM"] for c in recorders["_qk_norm_rope_kernel"].launched] == [True]
    assert len(recorders["_silu_mul_kernel"].launched) == 1


def compiled_variants(kernel) -> int:
    """Entries in a @triton.jit kernel's compile cache, over every device (Triton 3.x keeps them
    in device_caches[device][0]; older versions in cache[device])."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@gpu_test
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(16, 8, 128), (32, 8, 128)])
def test_gpu_serving_after_warm_up_compiles_nothing(heads, kv_heads, head_dim):
    dtype = torch.bfloat16
    attention.warm_up(heads, kv_heads, head_dim, 16, dtype, "cuda")
    kernels = (attention._paged_attention_kernel, attention._combine_splits_kernel)
    before = [compiled_variants(k) for k in kernels]
    rng = random.Random(head_dim)
    for step in range(12):
        num_seqs = rng.choice([1, 2, 17, 64, 256])
        decode = step % 2 == 0
        query_lens = [1 if decode else rng.randrange(1, 200) for _ in range(num_seqs)]
        seq_lens = [q + rng.randrange(0, 3000) for q in query_lens]
        batch = make_batch(
            query_lens,
            seq_lens,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            seed=step,
        )
        q = batch.q.new_empty(batch.q.shape)  # the model's q is a fresh contiguous tensor
        q.copy_(batch.q)
        attention.paged_attention(q, *batch.args()[1:])
    torch.cuda.synchronize()
    assert [compiled_variants(k) for k in kernels] == before


# --- launch plans -------------------------------------------------------------------------------


def test_a_signature_is_checked_and_planned_once():
    batch = make_batch([1, 3], [9, 3], seed=5)
    attention.launch_plan.cache_clear()
    first = assert_matches_reference(batch)
    second = attention.paged_attention(*batch.args())
    info = attention.launch_plan.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert torch.equal(first, second)
    # another stride is another signature: q as a view of a fused qkv row
    wide = torch.zeros((4, 3 * batch.q.shape[1], batch.q.shape[2]), dtype=batch.q.dtype)
    wide = wide.to(batch.q.device)
    wide[:, : batch.q.shape[1]] = batch.q
    view = wide[:, : batch.q.shape[1]]
    torch.testing.assert_close(attention.paged_attention(view, *batch.args()[1:]), first)
    assert attention.launch_plan.cache_info().misses == 2


def test_a_bad_signature_raises_every_time_not_only_the_first():
    batch = make_batch([1, 3], [9, 3])
    bad = (batch.q, batch.k_cache.half(), *batch.args()[2:])
    for _ in range(2):
        with pytest.raises(ValueError, match="k_cache dtype torch.float16 must equal q dtype"):
            attention.paged_attention(*bad)
    with pytest.raises(ValueError, match="k must be a torch.Tensor, got list"):
        store.store_kv([], batch.q, batch.k_cache, batch.v_cache, batch.seq_lens)
