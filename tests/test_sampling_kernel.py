"""The draw's kernel (kernels/sampling_triton.py) under TRITON_INTERPRET=1 (or on CUDA): its Philox
bits are triton.language.random's, its exponential noise is exact where the race is decided, and
its tokens do not depend on how the batch is tiled; one function picks the backend; on CUDA the
ids come back through the pinned buffer, step after step."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from actorserve.actors.worker.sample_row import SampleRow
from actorserve.actors.worker.sampler import Sampler
from actorserve.actors.worker.token_readback import TokenReadback
from actorserve.kernels.sampling import draw_backend, gumbel_argmax, gumbel_argmax_triton
from actorserve.kernels.sampling_triton import exponential_of_uniform, philox_bits
from actorserve.messages.common import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Triton: needs CUDA or TRITON_INTERPRET=1",
)


@triton.jit
def _philox_against_randint(seed, out_ours, out_library, N: tl.constexpr):
    index = tl.arange(0, N)
    key = tl.full([1], seed, tl.int64).to(tl.uint64, bitcast=True)
    ours = philox_bits(
        (key & 0xFFFFFFFF).to(tl.uint32)[:, None],
        (key >> 32).to(tl.uint32)[:, None],
        index.to(tl.uint32)[None, :],
    )
    tl.store(out_ours + index[None, :], ours.to(tl.int32, bitcast=True))
    tl.store(out_library + index, tl.randint(seed, index).to(tl.int32, bitcast=True))


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 + 7, 2**63 - 25])
def test_philox_bits_are_triton_randint_for_a_scalar_key(seed):
    ours = torch.empty(64, dtype=torch.int32, device=DEVICE)
    library = torch.empty_like(ours)
    _philox_against_randint[(1,)](seed, ours, library, N=64)
    assert torch.equal(ours, library)
    assert len(set(ours.tolist())) == 64


@triton.jit
def _exponential(u_ptr, out_ptr, N: tl.constexpr):
    index = tl.arange(0, N)
    tl.store(out_ptr + index, exponential_of_uniform(tl.load(u_ptr + index)))


def test_exponential_noise_keeps_its_relative_precision_for_small_uniforms():
    """-log(1 - u): the smallest values (the race's winners) to float32's relative precision."""
    u64 = torch.cat([torch.logspace(-9.5, -0.01, 255, dtype=torch.float64), torch.tensor([0.5])])
    u = u64.float()
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _exponential[(1,)](u.to(DEVICE), out, N=256)
    exact = -torch.log1p(-u.double())
    relative = ((out.cpu().double() - exact) / exact).abs()
    small = u < 2**-6
    assert relative[small].max() < 3e-7
    assert relative[~small].max() < 5e-6  # 1 - u rounds to float32 first


def test_tokens_do_not_depend_on_vocabulary_ranges_or_row_tiling():
    generator = torch.Generator().manual_seed(0)
    z = (torch.randn(6, 2500, generator=generator) * 3).to(DEVICE)
    z[1, ::2] = float("-inf")  # a filtered row: only odd tokens may win
    keys = torch.randint(2**62, (6,), generator=generator).to(DEVICE)
    whole = gumbel_argmax_triton(z, keys)
    assert whole[1] % 2 == 1
    for ranges in (2, 3):  # 1024-entry tiles: 3 ranges of 1024, 1024, 452
        assert torch.equal(gumbel_argmax_triton(z, keys, ranges), whole)
    order = torch.tensor([4, 0, 5])
    assert torch.equal(gumbel_argmax_triton(z[order], keys[order]), whole[order])
    small = z[:, :40].contiguous()  # 40 entries: tiles of several rows
    assert torch.equal(gumbel_argmax_triton(small[order], keys[order]),
                       gumbel_argmax_triton(small, keys)[order])  # fmt: skip


def test_a_row_of_minus_infinity_but_one_token_draws_that_token():
    z = torch.full((3, 3000), float("-inf"), device=DEVICE)
    z[0, 2999], z[1, 0], z[2, 1500] = 0.0, 5.0, -30.0
    keys = torch.tensor([1, 2, 3], device=DEVICE)
    for ranges in (1, 3):
        assert gumbel_argmax_triton(z, keys, ranges).tolist() == [2999, 0, 1500]


def test_one_function_picks_the_backend_and_the_sampler_takes_its_choice():
    assert draw_backend("cuda") == "triton" and draw_backend(torch.device("cuda", 1)) == "triton"
    assert draw_backend("cpu") == "torch"
    assert Sampler().backend == "torch"
    with pytest.raises(ValueError, match="backend"):
        gumbel_argmax(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64), "numpy")


@pytest.mark.gpu
def test_ids_come_back_through_the_pinned_buffer_step_after_step():
    readback = TokenReadback("cuda")
    first = readback.start(torch.arange(5, device="cuda") * 3)
    second = readback.start(torch.arange(200, device="cuda"))  # grows the buffer
    third = readback.start(torch.tensor([7, 8], device="cuda"))  # reuses it
    assert third.tolist() == [7, 8]
    assert second.tolist() == list(range(200)) and first.tolist() == [0, 3, 6, 9, 12]
    assert readback.pinned.is_pinned() and third.device.is_cuda


@pytest.mark.gpu
def test_cuda_sampler_draws_on_the_device_and_splits_small_batches():
    sampler = Sampler(device="cuda")
    assert sampler.backend == "triton" and sampler.min_programs > 0
    z = torch.randn(2, 150_000, device="cuda")
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=9), 5, 0, [], [0] * 5)] * 2
    sampled = sampler.sample(z, rows)
    assert sampled.device.is_cuda and sampled.tolist()[0] == sampled.tolist()[1]
    keys = torch.tensor([1, 2], device="cuda")
    assert torch.equal(gumbel_argmax(z, keys, "triton", sampler.min_programs),
                       gumbel_argmax_triton(z, keys))  # fmt: skip


def test_warm_up_draws_once_over_the_vocabulary():
    sampler = Sampler(device=DEVICE, backend="triton")
    sampler.warm_up(3000)
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=2), 4, 0, [], [0] * 4)]
    assert 0 <= sampler(torch.randn(1, 3000, device=DEVICE), rows)[0] < 3000


@pytest.mark.gpu
def test_after_warm_up_no_batch_size_compiles_another_variant():
    from actorserve.kernels.sampling_triton import gumbel_argmax_kernel

    sampler = Sampler(device="cuda")
    sampler.warm_up(151_936)
    device = torch.cuda.current_device()
    compiled = len(gumbel_argmax_kernel.device_caches[device][0])
    for batch in (1, 3, 16, 33, 256):
        z = torch.randn(batch, 151_936, device="cuda")
        keys = torch.arange(batch, device="cuda")
        gumbel_argmax(z, keys, "triton", sampler.min_programs)
    assert len(gumbel_argmax_kernel.device_caches[device][0]) == compiled
