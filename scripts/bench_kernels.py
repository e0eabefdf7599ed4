"""Benchmark the Triton paged attention against torch SDPA over an already-gathered cache.

Shape of every case: block_size 16, Hq 32, Hkv 8, head_dim 128, bf16, uniform batches.
    decode:  B sequences of `context` cached tokens, one query each. Reports achieved HBM
             bandwidth = (bytes of K and V read + bytes of q) / time, and % of --peak-tbps.
    prefill: B sequences of `context` fresh tokens (causal). Reports TFLOP/s with
             FLOPs = 4 * B * Hq * D * context * (context + 1) / 2, and the ratio to SDPA.
SDPA runs on contiguous [B, H, L, D] K/V (the same work without paging), flash / cuDNN /
mem-efficient backends only (never the O(L^2)-memory math fallback), GQA native where torch
supports it (`enable_gqa`), else with K/V heads expanded (marked "expanded": it then reads more).

Usage:
    python scripts/bench_kernels.py [--quick] [--json PATH] [--check]
    python scripts/bench_kernels.py --compile-only [--arch 90] [--quick]   # no GPU needed

--check exits 1 when the goals are missed (decode >= 70% of peak at 64 x 4096, prefill >= 60% of
SDPA on every row). --compile-only compiles, for the given sm_ arch, every kernel configuration
the benchmark grid (and the test shapes) would launch, and checks its shared memory fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

BLOCK_SIZE = 16
NUM_Q_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
DECODE_BATCHES = (1, 4, 16, 64, 128, 256)
DECODE_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
PREFILL_BATCHES = (1, 4, 16, 64, 128, 256)
PREFILL_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
PREFILL_TOKEN_BUDGET = 131072  # B * context per prefill case
QUICK_DECODE = ((1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 2048))
QUICK_PREFILL = ((1, 4096), (4, 2048), (16, 1024), (1, 16384))
GOAL_DECODE_CASE = (64, 4096)
GOAL_DECODE_PCT = 70.0
GOAL_PREFILL_RATIO = 0.60


# --- GPU benchmark ----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    kind: str
    batch: int
    context: int
    num_kv_splits: int
    triton_us: float
    sdpa_us: float | None
    sdpa_mode: str  # "gqa", "expanded" or "n/a"
    max_abs_err: float | None
    tbps: float | None = None  # decode: achieved bandwidth, TB/s
    pct_peak: float | None = None
    sdpa_tbps: float | None = None
    tflops: float | None = None  # prefill
    sdpa_tflops: float | None = None
    ratio_vs_sdpa: float | None = None  # prefill: triton TFLOP/s / SDPA TFLOP/s


def _paged_copy(contiguous, block_tables, num_blocks):
    """[B, Hkv, L, D] contiguous K or V -> [num_blocks, BLOCK_SIZE, Hkv, D] paged through the
    table, one sequence at a time (bounded transient memory)."""
    import torch

    batch, heads, length, dim = contiguous.shape
    cache = torch.empty(
        (num_blocks, BLOCK_SIZE, heads, dim), dtype=contiguous.dtype, device=contiguous.device
    )
    flat = cache.view(-1, heads, dim)
    positions = torch.arange(length, device=contiguous.device)
    for b in range(batch):
        blocks = block_tables[b, positions // BLOCK_SIZE].long()
        slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        flat[slots] = contiguous[b].transpose(0, 1)
    return cache


def _sdpa_runner(q4, k4, v4, causal):
    """A zero-argument SDPA call restricted to fused backends, and its GQA mode; None if none of
    them accepts the case."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ]
    group = q4.shape[1] // k4.shape[1]
    for mode in ("gqa", "expanded"):
        if mode == "gqa":
            k, v, extra = k4, v4, dict(enable_gqa=True)
        else:  # older torch, or no fused backend takes enable_gqa for this case
            k, v, extra = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1), {}

        def run(k=k, v=v, extra=extra):
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q4, k, v, is_causal=causal, **extra)

        try:
            run()
            torch.cuda.synchronize()
            return run, mode
        except (RuntimeError, TypeError) as exc:  # refused by every fused backend, or OOM
            print(
                f"  sdpa {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
                file=sys.stderr,
            )
            del k, v, run
            torch.cuda.empty_cache()
    return None, "n/a"


def _bench(fn) -> float:
    """Median microseconds per call (L2 flushed between calls by do_bench)."""
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")


def _case(kind: str, batch: int, context: int, peak_tbps: float) -> Row:
    import torch

    from actorserve.kernels.attention_config import choose_config
    from actorserve.kernels.paged_attention import paged_attention

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(batch * 100003 + context)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=dev, generator=gen).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    kv_shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
    k4 = torch.randn(kv_shape, device=dev, dtype=dtype, generator=gen)
    v4 = torch.randn(kv_shape, device=dev, dtype=dtype, generator=gen)
    k_cache = _paged_copy(k4, block_tables, num_blocks)
    v_cache = _paged_copy(v4, block_tables, num_blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q_len = 1 if kind == "decode" else context
    query_start_loc = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * q_len
    q = torch.randn((batch * q_len, NUM_Q_HEADS, HEAD_DIM), device=dev, dtype=dtype, generator=gen)
    scale = HEAD_DIM**-0.5
    config = choose_config(q, k_cache, block_tables)

    def triton_call():
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)

    # SDPA layout [B, H, L, D]: a view of q for prefill, [B, Hq, 1, D] for decode.
    q4 = q.view(batch, q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
    sdpa, mode = _sdpa_runner(q4, k4, v4, causal=kind == "prefill")
    out = triton_call()
    triton_us = _bench(triton_call)
    sdpa_us = err = None
    if sdpa is not None:
        expected = sdpa().transpose(1, 2).reshape(out.shape)
        err = (out.float() - expected.float()).abs().max().item()
        sdpa_us = _bench(sdpa)
    row = Row(kind, batch, context, config.num_kv_splits, triton_us, sdpa_us, mode, err)
    elem = q.element_size()
    if kind == "decode":
        moved = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem + q.numel() * elem
        row.tbps = moved / triton_us / 1e6
        row.pct_peak = 100.0 * row.tbps / peak_tbps
        row.sdpa_tbps = moved / sdpa_us / 1e6 if sdpa_us else None
    else:
        flops = 4.0 * batch * NUM_Q_HEADS * HEAD_DIM * context * (context + 1) / 2
        row.tflops = flops / triton_us / 1e6
        row.sdpa_tflops = flops / sdpa_us / 1e6 if sdpa_us else None
        row.ratio_vs_sdpa = row.tflops / row.sdpa_tflops if row.sdpa_tflops else None
    return row


def _grid(quick: bool) -> list[tuple[str, int, int]]:
    if quick:
        return [("decode", b, c) for b, c in QUICK_DECODE] + [
            ("prefill", b, c) for b, c in QUICK_PREFILL
        ]
    cases = [("decode", b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    cases += [
        ("prefill", b, c)
        for c in PREFILL_CONTEXTS
        for b in PREFILL_BATCHES
        if b * c <= PREFILL_TOKEN_BUDGET
    ]
    return cases


def _bytes_needed(kind: str, batch: int, context: int) -> int:
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    q = batch * (1 if kind == "decode" else context) * NUM_Q_HEADS * HEAD_DIM * 2
    # paged + contiguous copies, q / out / SDPA out, expanded-head fallback headroom
    return 2 * kv + 4 * q + (kv if kind == "decode" else 0)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(rows: list[Row], peak_tbps: float) -> None:
    decode = [r for r in rows if r.kind == "decode"]
    prefill = [r for r in rows if r.kind == "prefill"]
    if decode:
        print(
            f"\nDECODE (bf16, Hq {NUM_Q_HEADS} / Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, "
            f"block {BLOCK_SIZE}; peak {peak_tbps} TB/s)"
        )
        print(
            f"{'batch':>6} {'context':>8} {'splits':>6} {'triton us':>10} {'TB/s':>6} "
            f"{'%peak':>6} {'sdpa us':>10} {'sdpa TB/s':>9} {'sdpa':>8} {'max err':>8}"
        )
        for r in decode:
            print(
                f"{r.batch:>6} {r.context:>8} {r.num_kv_splits:>6} {r.triton_us:>10.1f} "
                f"{r.tbps:>6.2f} {r.pct_peak:>6.1f} {_fmt(r.sdpa_us, '>10.1f')} "
                f"{_fmt(r.sdpa_tbps, '>9.2f')} {r.sdpa_mode:>8} {_fmt(r.max_abs_err, '>8.4f')}"
            )
    if prefill:
        print(
            f"\nPREFILL (causal; bf16, Hq {NUM_Q_HEADS} / Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, "
            f"block {BLOCK_SIZE})"
        )
        print(
            f"{'batch':>6} {'context':>8} {'triton ms':>10} {'TFLOP/s':>8} {'sdpa ms':>9} "
            f"{'sdpa TF/s':>9} {'vs sdpa':>8} {'sdpa':>8} {'max err':>8}"
        )
        for r in prefill:
            sdpa_ms = None if r.sdpa_us is None else r.sdpa_us / 1e3
            print(
                f"{r.batch:>6} {r.context:>8} {r.triton_us / 1e3:>10.3f} {r.tflops:>8.1f} "
                f"{_fmt(sdpa_ms, '>9.3f')} {_fmt(r.sdpa_tflops, '>9.1f')} "
                f"{_fmt(r.ratio_vs_sdpa, '>8.2f')} {r.sdpa_mode:>8} "
                f"{_fmt(r.max_abs_err, '>8.4f')}"
            )


def _goals(rows: list[Row]) -> bool:
    """Print the issue's goals against the measured rows; True when all measured ones are met."""
    ok = True
    goal = [r for r in rows if r.kind == "decode" and (r.batch, r.context) == GOAL_DECODE_CASE]
    if goal:
        met = goal[0].pct_peak >= GOAL_DECODE_PCT
        ok &= met
        print(
            f"goal decode {GOAL_DECODE_CASE[0]}x{GOAL_DECODE_CASE[1]}: "
            f"{goal[0].pct_peak:.1f}% of peak (>= {GOAL_DECODE_PCT}%) "
            f"{'met' if met else 'MISSED'}"
        )
    ratios = [r.ratio_vs_sdpa for r in rows if r.kind == "prefill" and r.ratio_vs_sdpa]
    if ratios:
        met = min(ratios) >= GOAL_PREFILL_RATIO
        ok &= met
        median = sorted(ratios)[len(ratios) // 2]
        print(
            f"goal prefill: worst {min(ratios):.2f}x, median {median:.2f}x of SDPA "
            f"(>= {GOAL_PREFILL_RATIO}) {'met' if met else 'MISSED'}"
        )
    return ok


def run_benchmark(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_kernels: no CUDA device (torch.cuda.is_available() is False); this "
            "benchmark needs a GPU. Use --compile-only to check the kernels compile without one.",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "bench_kernels: TRITON_INTERPRET is set; unset it to time the compiled kernels.",
            file=sys.stderr,
        )
        return 2
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}"
    )
    rows = []
    for kind, batch, context in _grid(args.quick):
        free, _ = torch.cuda.mem_get_info()
        if _bytes_needed(kind, batch, context) > 0.85 * free:
            print(
                f"skip {kind} {batch}x{context}: needs more than the free {free / 2**30:.1f} GiB",
                file=sys.stderr,
            )
            continue
        try:
            row = _case(kind, batch, context, args.peak_tbps)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"skip {kind} {batch}x{context}: out of memory", file=sys.stderr)
            continue
        torch.cuda.empty_cache()  # the case's tensors died with _case
        rows.append(row)
        print(f"  {kind} {batch}x{context}: {row.triton_us:.1f} us", file=sys.stderr, flush=True)
    _print_table(rows, args.peak_tbps)
    print()
    ok = _goals(rows)
    from kernel_variants import compiled_variants  # scripts/, this script's folder

    print(f"compiled Triton variants: {compiled_variants()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 1 if args.check and not ok else 0


# --- compile-only ---------------------------------------------------------------------------


def _compile_cases(quick: bool):
    """(label, dtype, head_dim, Hq, Hkv, block_size, T, B, max_blocks) the bench and tests hit."""
    cases = []
    for kind, batch, context in _grid(quick):
        tokens = batch if kind == "decode" else batch * context
        blocks = math.ceil(context / BLOCK_SIZE)
        shape = (HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE, tokens, batch, blocks)
        cases.append((f"bench {kind} {batch}x{context}", "bf16", *shape))
    for dtype in ("fp16", "fp32"):
        for head_dim in (64, 80, 96, 128):
            for group in (1, 8):
                for tokens in (4, 4096):  # 4 decodes; 4 prefills of 1024
                    shape = (head_dim, 2 * group, 2, BLOCK_SIZE, tokens, 4, 64)
                    cases.append((f"{dtype} D{head_dim} G{group} T{tokens}", dtype, *shape))
            if quick:
                break
    for tokens in (4, 4096):
        cases.append((f"bf16 D256 G2 T{tokens}", "bf16", 256, 4, 2, BLOCK_SIZE, tokens, 4, 64))
    # a mixed step: 7 decodes and one 33-token chunk (64-row query blocks)
    cases.append(
        ("bf16 mixed T40 B8", "bf16", HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE, 40, 8, 256)
    )
    return cases


def run_compile_only(args) -> int:
    """Every kernel configuration of the benchmark grid and the test shapes, compiled for
    --arch (scripts/compile_kernels.py)."""
    os.environ.pop("TRITON_INTERPRET", None)  # before any @triton.jit runs
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compile_kernels

    return compile_kernels.run(_compile_cases(args.quick), args.arch, NUM_KV_HEADS, BLOCK_SIZE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak (H200: 4.8)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the kernels for --arch without a GPU, check shared memory",
    )
    parser.add_argument("--arch", type=int, default=90, help="sm_ arch for --compile-only")
    args = parser.parse_args(argv)
    try:
        import actorserve.kernels  # noqa: F401
    except ImportError:
        print(
            "bench_kernels: cannot import actorserve.kernels; run `pip install -e .` in the "
            "repository first.",
            file=sys.stderr,
        )
        return 2
    return run_compile_only(args) if args.compile_only else run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
