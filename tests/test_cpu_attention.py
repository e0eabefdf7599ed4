"""The CPU serving kernel (kernels/cpu.py) against the torch reference: decodes grouped by length,
prefill chunks with and without a cached prefix, GQA and MHA, block sizes, junk past a sequence's
blocks, and the per-step layout it reuses across layers (and must not reuse across steps)."""

from __future__ import annotations

import random

import pytest
import torch
from test_kernels import TOLERANCES, make_batch

from actorserve.kernels import attention_ops, cpu, reference


def assert_matches(batch) -> None:
    for _ in range(2):  # the second call reuses the cached layout
        torch.testing.assert_close(
            cpu.paged_attention(*batch.args()),
            reference.paged_attention(*batch.args()),
            **TOLERANCES[torch.float32],
        )


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1, 1, 1, 1], [7, 33, 64, 100]),  # decodes, one group, padded
        ([1] * 4, [16, 32, 48, 64]),  # decodes ending on block boundaries
        ([1] * 3, [32, 32, 32]),  # nothing padded: no mask
        ([12, 30, 17], [12, 30, 17]),  # first prefill chunks: plain causal
        ([24, 9], [64, 32]),  # later chunks over a cached prefix
        ([1, 20, 1, 7, 1], [50, 20, 9, 7, 130]),  # mixed
    ],
)
@pytest.mark.parametrize(
    "heads", [dict(num_q_heads=4, num_kv_heads=2), dict(num_q_heads=4, num_kv_heads=4)]
)
@pytest.mark.parametrize("block_size", [8, 16])
def test_matches_reference(query_lens, seq_lens, heads, block_size):
    assert_matches(make_batch(query_lens, seq_lens, block_size=block_size, **heads))


def test_many_decodes_span_several_length_groups():
    rng = random.Random(0)
    lens = [rng.randint(1, 300) for _ in range(3 * cpu.DECODE_GROUP + 5)]
    assert_matches(make_batch([1] * len(lens), lens, num_q_heads=6, num_kv_heads=2))


def test_a_new_step_with_other_metadata_is_not_served_the_old_layout():
    a = make_batch([1, 1], [20, 40], seed=1)
    b = make_batch([1, 1], [40, 20], seed=1)  # same shapes and cache, lengths swapped
    for batch in (a, b, a):
        torch.testing.assert_close(
            cpu.paged_attention(*batch.args()),
            reference.paged_attention(*batch.args()),
            **TOLERANCES[torch.float32],
        )


def test_auto_picks_the_cpu_kernels_on_cpu():
    assert attention_ops("cpu").name == "cpu"
    assert attention_ops("cpu", "reference").name == "reference"
