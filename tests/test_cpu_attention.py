"""The CPU serving kernels (kernels/cpu/attention.py) against torch, on both paths: the C kernels
that read the paged cache directly (decodes: csrc/cpu_decode.c, prefill chunks: cpu_prefill.c) and
the torch path kept for machines without a compiler (grouped decodes, SDPA for prefill chunks).
Decodes of many lengths, prefill chunks with and without a cached prefix and over several tiles,
GQA and MHA, head sizes, block sizes, junk past a sequence's blocks, and the per-step layout
reused across layers (and not across steps). Also store_kv, and the argmax (csrc/cpu_argmax.c)
and the LM head with the argmax fused in (csrc/cpu_panel_gemm.c) against torch's
max(dim=-1).indices, and that file's decode-sized Linear against torch's product."""

from __future__ import annotations

import fnmatch
import random
from pathlib import Path

import pytest
import torch

from actorserve.kernels import attention_ops, reference
from actorserve.kernels.cpu import attention as cpu
from actorserve.kernels.cpu import bindings, build, panels
from kernel_support import TOLERANCES, make_batch

PATHS = [pytest.param(True, id="c-kernels"), pytest.param(False, id="torch")]


@pytest.fixture(params=PATHS)
def attention(request) -> cpu.CpuAttention:
    ops = cpu.CpuAttention(use_native=request.param)
    assert (ops.native is not None) == request.param, "the C kernel failed to build here"
    return ops


def assert_matches(attention: cpu.CpuAttention, batch) -> None:
    for _ in range(2):  # the second call reuses the cached layout
        torch.testing.assert_close(
            attention.paged_attention(*batch.args()),
            reference.paged_attention(*batch.args()),
            **TOLERANCES[torch.float32],
        )


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1, 1, 1, 1], [7, 33, 64, 100]),  # decodes, one group, padded
        ([1] * 4, [16, 32, 48, 64]),  # decodes ending on block boundaries
        ([1] * 3, [32, 32, 32]),  # nothing padded: no mask
        ([1], [1]),  # a decode whose context is its own token
        ([12, 30, 17], [12, 30, 17]),  # first prefill chunks: plain causal
        ([24, 9], [64, 32]),  # later chunks over a cached prefix
        ([1, 20, 1, 7, 1], [50, 20, 9, 7, 130]),  # mixed
    ],
)
@pytest.mark.parametrize(
    "heads", [dict(num_q_heads=4, num_kv_heads=2), dict(num_q_heads=4, num_kv_heads=4)]
)
@pytest.mark.parametrize("block_size", [8, 16])
def test_matches_reference(attention, query_lens, seq_lens, heads, block_size):
    assert_matches(attention, make_batch(query_lens, seq_lens, block_size=block_size, **heads))


@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])  # 72: not whole 16-float vectors
def test_head_sizes(attention, head_dim):
    batch = make_batch([1, 3, 1], [40, 19, 77], head_dim=head_dim, num_q_heads=8, num_kv_heads=2)
    assert_matches(attention, batch)


@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])  # 72: not whole 16-float vectors
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)])
def test_long_prefill_chunks_span_several_tiles(attention, head_dim, heads):
    # chunks of 16 and 17 tokens (a whole tile, one past it), 40 over a cached prefix, a decode
    batch = make_batch(
        [16, 17, 40, 1, 33], [16, 50, 100, 9, 33], head_dim=head_dim,
        num_q_heads=heads[0], num_kv_heads=heads[1],
    )  # fmt: skip
    assert_matches(attention, batch)


@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_each_prefill_row_is_the_decode_kernels_result_for_its_token(head_dim):
    """A chunk's token at position p attends to positions 0..p: exactly a decode of that token
    over a context of p + 1 (cpu_prefill.c shares the decode kernel's arithmetic)."""
    lib = bindings.load()
    batch = make_batch(
        [40, 1, 23], [70, 12, 23], head_dim=head_dim, num_q_heads=6, num_kv_heads=2, seed=3
    )
    q, k_cache, v_cache, tables, seq_lens, starts, scale = batch.args()
    out = torch.full_like(q, float("nan"))
    for rows in ("decode", "prefill"):
        args = (q, k_cache, v_cache, tables, seq_lens, starts, scale, out)
        bindings.paged_attention(lib, rows, *args)
    # the same step as one-token sequences: token t of sequence b, context up to its position
    rows, lens = [], []
    for b in range(len(seq_lens)):
        n = int(starts[b + 1] - starts[b])
        for j in range(n):
            rows.append(b)
            lens.append(int(seq_lens[b]) - n + j + 1)
    single = torch.full_like(q, float("nan"))
    bindings.paged_attention(
        lib, "decode", q, k_cache, v_cache, tables[rows].contiguous(),
        torch.tensor(lens, dtype=torch.int32), torch.arange(len(rows) + 1, dtype=torch.int32),
        scale, single,
    )  # fmt: skip
    assert torch.equal(out, single)


def test_many_decodes_span_several_length_groups(attention):
    rng = random.Random(0)
    lens = [rng.randint(1, 300) for _ in range(3 * cpu.DECODE_GROUP + 5)]
    assert_matches(attention, make_batch([1] * len(lens), lens, num_q_heads=6, num_kv_heads=2))


def test_a_new_step_with_other_metadata_is_not_served_the_old_layout(attention):
    a = make_batch([1, 1], [20, 40], seed=1)
    b = make_batch([1, 1], [40, 20], seed=1)  # same shapes and cache, lengths swapped
    for batch in (a, b, a):
        torch.testing.assert_close(
            attention.paged_attention(*batch.args()),
            reference.paged_attention(*batch.args()),
            **TOLERANCES[torch.float32],
        )


def test_half_precision_with_prefill_chunks_falls_back_to_the_torch_path(monkeypatch):
    def no_c(*args):
        raise AssertionError("steps with prefill chunks read a bf16 cache in torch")

    monkeypatch.setattr(bindings, "paged_attention", no_c)
    batch = make_batch([1, 1, 5], [9, 40, 5], dtype=torch.bfloat16)
    torch.testing.assert_close(
        cpu.CpuAttention().paged_attention(*batch.args()),
        reference.paged_attention(*batch.args()),
        **TOLERANCES[torch.bfloat16],
    )


def test_the_kernel_library_is_cached_by_content(tmp_path, monkeypatch):
    """build() over a one-function source: the caching is the same for any sources, and the
    real library's compile is what every kernel test here already waits for."""
    cache, source = tmp_path / "cache", tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setattr(build, "SOURCES", (source,))
    monkeypatch.setattr(build, "HEADERS", ())
    monkeypatch.setenv(build.CACHE_ENV, str(cache))
    first = build.build()
    assert first is not None and first.parent == cache
    built_inode = first.stat().st_ino  # a rebuild installs a new file (os.replace)
    compile_for_real = build.subprocess.run
    monkeypatch.setattr(build.subprocess, "run", _compiler_only_for_version(compile_for_real))
    assert build.build() == first  # a second build finds the first one, compiling nothing
    assert first.stat().st_ino == built_inode  # its mtime marks the use (prune)
    assert list(cache.iterdir()) == [first]
    monkeypatch.setattr(build.subprocess, "run", compile_for_real)
    source.write_text("int one(void) { return 2; }\n")  # changed content: another library
    second = build.build()
    assert second != first and set(cache.iterdir()) == {first, second}  # kept: prune() keeps 4


def test_an_installed_package_carries_every_file_the_kernel_library_is_built_from():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert "actorserve.kernels.cpu" in setuptools["packages"]
    package_dir = Path(build.__file__).parent
    patterns = setuptools["package-data"]["actorserve.kernels.cpu"]
    for source in build.SOURCES + build.HEADERS:
        path = source.relative_to(package_dir).as_posix()  # found next to the module, installed
        assert any(fnmatch.fnmatch(path, p) for p in patterns), path


def _compiler_only_for_version(run):
    def guarded(command, *args, **kwargs):
        if "--version" not in command:
            raise AssertionError(f"compiled again: {command}")
        return run(command, *args, **kwargs)

    return guarded


def test_auto_picks_the_cpu_kernels_on_cpu_and_the_reference_without_the_fast_path():
    assert attention_ops("cpu").name == "cpu"
    assert attention_ops("cpu", "reference").name == "reference"
    assert attention_ops("cpu", c_kernels=False).name == "reference"
    plain = attention_ops("cpu", "cpu", c_kernels=False)  # asked by name: its torch paths
    assert plain.name == "cpu" and plain.store_kv is reference.store_kv


@pytest.mark.parametrize("shape", [(64, 32000), (3, 17), (1, 1), (5, 100003)])
def test_argmax_rows_is_the_first_maximum_of_each_row(shape):
    gen = torch.Generator().manual_seed(0)
    for logits in (
        torch.randn(shape, generator=gen),
        torch.randint(0, 3, shape, generator=gen).float(),  # ties everywhere
        torch.full(shape, float("-inf")),  # nothing but masked tokens
    ):
        assert torch.equal(cpu.argmax_rows(logits), logits.max(dim=-1).indices)
    strided = torch.randn(shape[0], shape[1] + 7, generator=gen)[:, 3 : 3 + shape[1]]
    assert torch.equal(cpu.argmax_rows(strided), strided.max(dim=-1).indices)


@pytest.mark.parametrize("vocab", [1, 47, 48, 49, 1000, 32000])
@pytest.mark.parametrize("hidden_size", [1, 16, 256])
def test_the_greedy_head_is_the_first_maximum_of_the_logits(vocab, hidden_size):
    """Small integers make every product exact, so ties are many and must go to the first."""
    gen = torch.Generator().manual_seed(vocab + hidden_size)
    weight = torch.randint(-2, 3, (vocab, hidden_size), generator=gen).float()
    head = panels.GreedyHead.for_weight(weight)
    assert head is not None, "the C kernels failed to build here"
    for rows in (1, 7, 8, 9, 64):
        hidden = torch.randint(-2, 3, (rows, hidden_size), generator=gen).float()
        assert torch.equal(head(hidden), (hidden @ weight.T).max(dim=-1).indices)
    wide = torch.randint(-2, 3, (5, hidden_size + 3), generator=gen).float()
    strided = wide[:, 2 : 2 + hidden_size]
    assert torch.equal(head(strided), (strided @ weight.T).max(dim=-1).indices)
    column_major = panels.GreedyHead.for_weight(weight.t().contiguous().t())  # as the Linear layers
    assert torch.equal(column_major(hidden), head(hidden))


@pytest.mark.parametrize("out_features", [1, 47, 48, 49, 768])
@pytest.mark.parametrize("in_features", [1, 16, 256])
def test_the_panel_linear_is_the_product_with_the_weight(out_features, in_features):
    """Small integers make every product exact: the kernel must give torch's result exactly."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randint(-2, 3, (out_features, in_features), generator=gen).float()
    linear = panels.PanelLinear.for_weight(weight.t().contiguous().t())  # column-major, as served
    assert linear is not None, "the C kernels failed to build here"
    for rows in (1, 7, 8, 9, 64, 130):
        x = torch.randint(-2, 3, (rows, in_features), generator=gen).float()
        assert torch.equal(linear(x), x @ weight.T)
    wide = torch.randint(-2, 3, (5, in_features + 3), generator=gen).float()
    strided = wide[:, 2 : 2 + in_features]
    assert torch.equal(linear(strided), strided @ weight.T)


def test_the_greedy_head_refuses_what_it_cannot_serve():
    assert panels.GreedyHead.for_weight(torch.ones(4, 4, dtype=torch.float64)) is None
    assert panels.PanelLinear.for_weight(torch.ones(4, 4, dtype=torch.float64)) is None


def test_store_kv_matches_the_reference_from_strided_rows_and_skips_minus_one():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 8, 64, generator=gen)  # [T, Hq + 2 Hkv, D] like the fused projection
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 17, -1, 40, 0, 63])
    ours = [torch.zeros(4, 16, 2, 64) for _ in range(2)]
    ref = [torch.zeros(4, 16, 2, 64) for _ in range(2)]
    cpu.store_kv(k, v, *ours, slots)
    reference.store_kv(k, v, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    with pytest.raises(IndexError):
        cpu.store_kv(k, v, *ours, torch.tensor([3, 17, -1, 64, 0, 1]))
