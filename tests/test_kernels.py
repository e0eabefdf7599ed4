"""Triton paged attention against the torch reference (and the reference against a
naive per-token loop). On CPU the kernels run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), so the cases are small; `gpu`-marked cases are larger and need CUDA.

Tolerances: tests/kernel_support.py. The KV store: tests/test_store_kv.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from actorserve.kernels import reference
from actorserve.kernels.attention_config import LaunchConfig, choose_config
from actorserve.kernels.paged_attention import paged_attention
from kernel_support import (
    DEVICE,
    TOLERANCES,
    Batch,
    assert_matches_reference,
    gpu_test,
    make_batch,
    naive_paged_attention,
)

# --- the reference itself ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "query_lens, seq_lens, block_size, heads",
    [
        ([1, 1, 1], [1, 17, 40], 16, (4, 1)),  # decodes only, GQA 4
        ([5, 1, 9], [5, 23, 30], 8, (4, 2)),  # prefill, decode, chunk with cached prefix
        ([16, 3], [32, 3], 16, (2, 2)),  # chunk exactly one block after a one-block prefix
    ],
)
def test_reference_matches_naive_per_token_loop(query_lens, seq_lens, block_size, heads):
    batch = make_batch(
        query_lens,
        seq_lens,
        block_size=block_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        device="cpu",
    )
    expected = naive_paged_attention(*batch.args())
    out = reference.paged_attention(*batch.args())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_ignores_garbage_block_table_entries_in_decode():
    batch = make_batch([1, 1], [3, 40], block_size=8, device="cpu")
    assert int(batch.block_tables[0, 1]) >= batch.k_cache.shape[0]  # garbage past block 0
    expected = naive_paged_attention(*batch.args())
    out = reference.paged_attention(*batch.args())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# --- paged attention: batch shapes ------------------------------------------------------------


def test_decode_only_batch():
    assert_matches_reference(make_batch([1, 1, 1, 1], [7, 33, 64, 100]), num_kv_splits=1)


def test_prefill_only_batch():
    assert_matches_reference(make_batch([12, 30, 1 + 16], [12, 30, 17]))


def test_mixed_prefill_and_decode_in_one_call():
    assert_matches_reference(make_batch([1, 20, 1, 7, 1], [50, 20, 9, 7, 130]))


def test_sequence_with_no_queries_this_step_is_ignored():
    batch = make_batch([1, 1, 5], [20, 9, 30])
    # drop sequence 1's query: it stays in the batch with an empty query range
    keep = [0, 2, 3, 4, 5, 6]
    batch.q = batch.q[keep].contiguous()
    batch.query_start_loc = torch.tensor([0, 1, 1, 6], dtype=torch.int32, device=DEVICE)
    assert_matches_reference(batch)


def test_prefill_chunk_attends_to_cached_prefix():
    # chunks of 24 and 9 queries after cached prefixes of 40 and 23 positions
    assert_matches_reference(make_batch([24, 9], [64, 32], block_size=8))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_context_lengths_at_block_edges(block_size):
    """Lengths 1, one short of a block, exactly one block, one past it, not a multiple."""
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    assert_matches_reference(make_batch([1] * len(lens), lens, block_size=block_size))
    # the same lengths as whole prefills, where the causal mask does the work
    assert_matches_reference(make_batch(lens, lens, block_size=block_size, seed=1))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes_with_shuffled_block_ids(block_size):
    batch = make_batch([1, 6, 1], [45, 37, 70], block_size=block_size, seed=block_size)
    ids = batch.block_tables[2, : -(-70 // block_size)]
    assert not torch.equal(ids.sort().values, ids)  # the table really is shuffled
    assert_matches_reference(batch)


@pytest.mark.parametrize("group", [1, 2, 4, 8, 3])  # 3: a query block with padding rows
def test_gqa_ratios(group):
    batch = make_batch([1, 11, 1], [29, 40, 3], num_q_heads=2 * group, num_kv_heads=2, seed=group)
    assert_matches_reference(batch)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_head_dims_including_non_powers_of_two(head_dim):
    assert_matches_reference(make_batch([1, 9], [36, 20], head_dim=head_dim, seed=head_dim))


def test_fp16_within_stated_tolerance():
    batch = make_batch(
        [1, 14, 1], [70, 30, 18], num_q_heads=8, num_kv_heads=2, dtype=torch.float16, head_dim=96
    )
    assert_matches_reference(batch)


def test_query_view_with_row_stride_from_fused_qkv():
    batch = make_batch([1, 10], [25, 10], num_q_heads=4, num_kv_heads=2)
    t, h, d = batch.q.shape
    qkv = torch.randn(t, (h + 4) * d, device=DEVICE)
    qkv[:, : h * d] = batch.q.reshape(t, h * d)
    batch.q = qkv[:, : h * d].view(t, h, d)  # row stride (h + 4) * d, not h * d
    assert not batch.q.is_contiguous()
    assert_matches_reference(batch)


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_across_shapes(seed):
    """Seeded random batches: decodes, fresh prefills and chunks with a prefix, random block size,
    GQA ratio, head_dim and dtype, each through the automatic config and forced split-KV."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    block_size, group, head_dim = pick([8, 16, 32]), pick([1, 2, 4, 8]), pick([64, 80, 96, 128])
    dtype = pick([torch.float32, torch.float16])
    query_lens, seq_lens = [], []
    for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
        kind = pick(["decode", "prefill", "chunk"])
        seq_len = int(torch.randint(1, 90, (1,), generator=gen))
        q_len = {
            "decode": 1,
            "prefill": seq_len,
            "chunk": int(torch.randint(1, seq_len + 1, (1,), generator=gen)),
        }[kind]
        query_lens.append(q_len)
        seq_lens.append(seq_len)
    batch = make_batch(
        query_lens,
        seq_lens,
        block_size=block_size,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    assert_matches_reference(batch)
    assert_matches_reference(batch, num_kv_splits=3)


# --- paged attention: tiling and split-KV -------------------------------------------------------


@pytest.mark.parametrize(
    "config, block_size",
    [
        (LaunchConfig(block_m=16, tile_n=16), 32),  # tile smaller than a block
        (LaunchConfig(block_m=64, tile_n=64), 8),  # tile spans eight blocks
        (LaunchConfig(block_m=128, tile_n=32), 16),  # many query tokens per program
    ],
)
def test_tile_size_is_independent_of_block_size(config, block_size):
    batch = make_batch([1, 19, 1, 40], [77, 45, 5, 40], block_size=block_size, seed=7)
    assert_matches_reference(batch, config=config)


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_decode_matches_unsplit(splits):
    # 8 splits of a context of 1..3 tiles leaves some splits empty
    batch = make_batch([1, 1, 1], [1, 70, 130], num_q_heads=8, num_kv_heads=2)
    split = assert_matches_reference(batch, num_kv_splits=splits)
    unsplit = paged_attention(*batch.args(), num_kv_splits=1)
    torch.testing.assert_close(split, unsplit, **TOLERANCES[batch.q.dtype])


def test_split_kv_with_prefill_chunks_and_fp16():
    batch = make_batch([1, 18, 1], [90, 50, 33], dtype=torch.float16, seed=3)
    assert_matches_reference(batch, num_kv_splits=4)


def test_config_chooses_split_kv_for_few_long_decodes_only():
    def config(query_lens, seq_lens, **kw):
        batch = make_batch(
            query_lens, seq_lens, num_q_heads=32, num_kv_heads=8, dtype=torch.float16, **kw
        )
        return choose_config(batch.q, batch.k_cache, batch.block_tables, num_sms=132)

    assert config([1], [500]).num_kv_splits > 1  # 8 programs cannot fill 132 SMs
    assert config([1] * 300, [20] * 300).num_kv_splits == 1  # 2400 programs can
    assert config([30, 1], [30, 500]).num_kv_splits == 1  # prefill chunks never split
    assert config([1], [5]).num_kv_splits == 1  # table holds one 64-position tile: no split
    assert config([1, 1], [40, 40]).block_m == 16  # one decode token x 4 heads, padded to 16
    assert config([300], [300]).block_m == 128  # long prefill: big query blocks
    with pytest.raises(ValueError, match="num_kv_splits must be in 1..64"):
        LaunchConfig(num_kv_splits=0)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        LaunchConfig(block_m=24)


def test_block_m_smaller_than_query_group_is_rejected():
    batch = make_batch([1], [10], num_q_heads=32, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"config.block_m \(16\) must be >= Hq // Hkv \(32\)"):
        paged_attention(*batch.args(), config=LaunchConfig(block_m=16))


# --- paged attention: argument checks ---------------------------------------------------------


def _replace(batch: Batch, **changes) -> tuple:
    return dataclasses.replace(batch, **changes).args()


BAD_ATTENTION_ARGS = [
    ("q 2-D", lambda b: _replace(b, q=b.q[:, 0]), r"q must be \[T, Hq, D\]"),
    (
        "int q",
        lambda b: _replace(b, q=b.q.int(), k_cache=b.k_cache.int(), v_cache=b.v_cache.int()),
        "q dtype must be float16, bfloat16 or float32",
    ),
    (
        "cache dtype",
        lambda b: _replace(b, k_cache=b.k_cache.half()),
        "k_cache dtype torch.float16 must equal q dtype torch.float32",
    ),
    ("cache 3-D", lambda b: _replace(b, k_cache=b.k_cache[0]), r"k_cache must be \[num_blocks"),
    ("v shape", lambda b: _replace(b, v_cache=b.v_cache[:-1]), "v_cache shape .* must equal"),
    (
        "head dim",
        lambda b: _replace(b, q=b.q[..., :32].contiguous()),
        "k_cache head_dim 64 must equal q head_dim 32",
    ),
    (
        "gqa",
        lambda b: _replace(b, q=b.q[:, :3].contiguous()),
        r"q heads \(3\) must be a multiple of k_cache heads \(2\)",
    ),
    (
        "q stride",
        lambda b: _replace(b, q=b.q.transpose(0, 2).contiguous().transpose(0, 2)),
        "q must be contiguous in its last",
    ),
    (
        "table dtype",
        lambda b: _replace(b, block_tables=b.block_tables.long()),
        "block_tables must be a 2-D int32 tensor",
    ),
    (
        "seq_lens len",
        lambda b: _replace(b, seq_lens=b.seq_lens[:1]),
        r"seq_lens must be int32 of shape \[B\]=\(2,\)",
    ),
    ("seq_lens dtype", lambda b: _replace(b, seq_lens=b.seq_lens.long()), "seq_lens must be int32"),
    (
        "qsl len",
        lambda b: _replace(b, query_start_loc=b.query_start_loc[:2]),
        r"query_start_loc must be int32 of shape \[B\+1\]=\(3,\)",
    ),
]


@pytest.mark.parametrize("name, mutate, message", BAD_ATTENTION_ARGS, ids=lambda x: None)
def test_paged_attention_rejects_bad_arguments(name, mutate, message):
    batch = make_batch([1, 3], [9, 3])
    with pytest.raises(ValueError, match=message):
        paged_attention(*mutate(batch))


# --- compiled code paths, checked without a GPU -------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="Triton's NVIDIA backend (ptxas) is not installed",
)
def test_kernels_compile_for_hopper_within_shared_memory():
    """The interpreter never compiles; this builds every configuration the wrapper picks for the
    benchmark shapes (and fp16 / fp32 / head_dim variants) for sm_90, through ptxas."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [
            sys.executable,
            str(root / "scripts" / "bench_kernels.py"),
            "--compile-only",
            "--quick",
            "--arch",
            "90",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ", 0 failed" in result.stdout


# --- real GPU only ----------------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large_mixed_batch(dtype):
    query_lens = [1] * 24 + [300, 77, 1024]
    gen = torch.Generator().manual_seed(11)
    seq_lens = [int(x) for x in torch.randint(1, 3000, (24,), generator=gen)] + [1500, 77, 1024]
    batch = make_batch(
        query_lens, seq_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype, seed=11
    )
    assert_matches_reference(batch)


@gpu_test
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_gpu_long_decodes_take_split_kv_automatically(head_dim):
    batch = make_batch(
        [1, 1],
        [8000, 3001],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=head_dim,
    )
    assert choose_config(batch.q, batch.k_cache, batch.block_tables).num_kv_splits > 1
    assert_matches_reference(batch)
