"""What the kernel tests share: batches of paged attention inputs (random caches, shuffled block
tables), a naive per-token oracle, the tolerances of each dtype, the `gpu` marker, and the x86
levels the CPU panel kernels are built for (MARCHES).

Tolerances (max |kernel - reference| allowed, elementwise atol + rtol * |reference|):
    fp32: atol 2e-5, rtol 2e-5  (fp32 dots, "ieee" precision on GPU)
    fp16: atol 5e-3, rtol 1e-2  (inputs and the softmax probabilities fed to P @ V are fp16)
    bf16: atol 3e-2, rtol 3e-2  (GPU only: the interpreter has no native bf16 dot)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actorserve.kernels import reference
from actorserve.kernels.paged_attention import paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# Each vector width the CPU panels are built for: the library built for this CPU (-march=native),
# and where this CPU has AVX-512 also an AVX2 build (x86-64-v3), so both paths run here.
MARCHES = [
    "native",
    pytest.param(
        "x86-64-v3",
        marks=pytest.mark.skipif(
            not {"avx2", "fma", "avx512f"} <= cpu_flags(),
            reason="no AVX2 to run, or no AVX-512 (native is the AVX2 build then)",
        ),
    ),
]


def gpu_test(fn):
    return pytest.mark.gpu(requires_cuda(fn))


@dataclasses.dataclass
class Batch:
    """One paged-attention call's inputs; block ids are a random permutation of the cache's
    blocks, and table entries past a sequence's blocks hold an out-of-range id (never read)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 16,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = DEVICE,
) -> Batch:
    assert len(query_lens) == len(seq_lens)
    assert all(1 <= n <= s for n, s in zip(query_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold junk no sequence owns
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = ids[used : used + n]
        used += n
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], num_q_heads, head_dim), generator=gen).to(dtype)
    return Batch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def naive_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """The oracle of the oracle: one query token and one head at a time, keys fetched one cache
    position at a time through the block table, softmax in float64."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            token = starts[b] + i
            position = seq_len - q_len + i
            keys, values = [], []
            for p in range(position + 1):
                block = int(block_tables[b, p // block_size])
                keys.append(k_cache[block, p % block_size])
                values.append(v_cache[block, p % block_size])
            k = torch.stack(keys).double().cpu()  # [position + 1, Hkv, D]
            v = torch.stack(values).double().cpu()
            for h in range(q.shape[1]):
                scores = k[:, h // group] @ q[token, h].double().cpu() * scale
                out[token, h] = torch.softmax(scores, dim=0) @ v[:, h // group]
    return out


def assert_matches_reference(batch: Batch, **kwargs) -> torch.Tensor:
    out = paged_attention(*batch.args(), **kwargs)
    expected = reference.paged_attention(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[batch.q.dtype])
    return out
