"""Ahead-of-time compilation of the Triton kernels for a CUDA arch, without a GPU: every
configuration scripts/bench_kernels.py --compile-only hands over, the KV store and the fused
elementwise kernels, each checked against the arch's shared memory per block (the interpreter
the tests use never compiles)."""

from __future__ import annotations

import inspect
import time

# Largest dynamic shared memory per block, by sm_ arch (bytes).
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def _compile(
    kernel,
    pointer_types: dict[str, str],
    constexprs: dict,
    arch: int,
    num_warps: int,
    num_stages: int,
):
    """Ahead-of-time compile one @triton.jit kernel for cuda sm_<arch>; returns the kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the launcher sees for torch tensors
        elif name in ("qk_scale", "eps"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )


def _elementwise_jobs() -> list[tuple]:
    """The fused elementwise kernels (kernels/elementwise_triton.py) in the tilings their
    wrappers pick for Qwen3-0.6B- and Llama-3-8B-sized rows, and an odd head_dim, each dtype."""
    import triton

    from actorserve.kernels import elementwise_triton as ew

    jobs = []
    for dtype in ("bf16", "fp16", "fp32"):
        ptrs = {}.fromkeys(
            ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "sum_ptr", "gate_up_ptr"),
            f"*{dtype}",
        )
        ptrs.update(
            {}.fromkeys(("q_out_ptr", "k_out_ptr", "q_weight_ptr", "k_weight_ptr"), f"*{dtype}")
        )
        ptrs.update({}.fromkeys(("cos_ptr", "sin_ptr"), f"*{dtype}"))
        for hidden, inter in ((1024, 3072), (4096, 14336)):
            block_d, block_rows, warps = ew._norm_tiling(hidden)
            for residual in (False, True):
                consts = dict(
                    DIM=hidden, BLOCK_D=block_d, BLOCK_ROWS=block_rows, HAS_RESIDUAL=residual
                )
                jobs.append((f"rms_norm {dtype}", ew._rms_norm_kernel, ptrs, consts, warps, 1))
            consts = dict(INTER=inter, BLOCK=min(ew.SILU_BLOCK, triton.next_power_of_2(inter)))
            jobs.append((f"silu_mul {dtype}", ew._silu_mul_kernel, ptrs, consts, 4, 1))
        for heads, kv_heads, head_dim, norm in (
            (16, 8, 128, True),
            (32, 8, 128, False),
            (6, 3, 80, True),
        ):
            d_pad, block_h, _ = ew._norm_rope_tiling(head_dim, heads, kv_heads)
            consts = dict(HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_H=block_h, HAS_NORM=norm)
            jobs.append((f"qk_norm_rope {dtype}", ew._qk_norm_rope_kernel, ptrs, consts, 4, 1))
    return jobs


def run(cases, arch: int, store_kv_heads: int, store_kv_block_size: int) -> int:
    """Compile every configuration the cases (bench_kernels._compile_cases' tuples) make the
    wrapper pick, and the KV store, for sm_<arch>; 1 when one fails or overflows shared
    memory."""
    import torch

    from actorserve.kernels import attention_config
    from actorserve.kernels import paged_attention as attention
    from actorserve.kernels import store_kv as store

    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    limit = SHARED_MEMORY_LIMIT.get(arch, 101376)
    seen, failures = set(), 0
    jobs = []
    for label, dtype, head_dim, hq, hkv, block_size, tokens, batch, max_blocks in cases:
        q = torch.empty((tokens, hq, head_dim), dtype=torch_dtypes[dtype], device="meta")
        cache = torch.empty((1, block_size, hkv, head_dim), dtype=q.dtype, device="meta")
        tables = torch.empty((batch, max_blocks), dtype=torch.int32, device="meta")
        for sms in (132, 0):  # the H200's split choice, and no split
            config = attention_config.choose_config(q, cache, tables, num_sms=sms)
            consts, combine = attention_config.kernel_constexprs(
                head_dim, hq // hkv, block_size, dtype == "fp32", config
            )
            ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
            ptrs.update({n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")})
            jobs.append(
                (
                    label,
                    attention._paged_attention_kernel,
                    ptrs,
                    consts,
                    config.num_warps,
                    config.num_stages,
                )
            )
            if combine:
                ptrs = {
                    "out_ptr": f"*{dtype}",
                    "part_acc_ptr": "*fp32",
                    "part_m_ptr": "*fp32",
                    "part_l_ptr": "*fp32",
                }
                jobs.append(
                    (
                        label + " combine",
                        attention._combine_splits_kernel,
                        ptrs,
                        combine,
                        attention.COMBINE_NUM_WARPS,
                        1,
                    )
                )
    for dtype in ("bf16", "fp16", "fp32"):
        ptrs = {n: f"*{dtype}" for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs["slot_mapping_ptr"] = "*i64"
        consts = dict(
            NUM_HEADS=store_kv_heads,
            HEADS_PAD=store_kv_heads,
            HEAD_DIM=80,
            D_PAD=128,
            BLOCK_SIZE=store_kv_block_size,
        )
        jobs.append((f"store_kv {dtype}", store._store_kv_kernel, ptrs, consts, 4, 1))

    jobs += _elementwise_jobs()

    print(f"compiling for sm_{arch} (shared memory limit {limit} bytes)")
    for label, kernel, ptrs, consts, warps, stages in jobs:
        key = (
            kernel.fn.__name__,
            tuple(sorted(ptrs.items())),
            tuple(sorted(consts.items())),
            warps,
            stages,
        )
        if key in seen:
            continue
        seen.add(key)
        start = time.perf_counter()
        try:
            compiled = _compile(kernel, ptrs, consts, arch, warps, stages)
        except Exception as exc:  # report every failing configuration, not just the first
            failures += 1
            print(
                f"FAIL {label}: {kernel.fn.__name__} {consts} warps={warps} stages={stages}: "
                f"{type(exc).__name__}: {exc}"
            )
            continue
        shared = compiled.metadata.shared
        status = "ok" if shared <= limit else "TOO MUCH SHARED MEMORY"
        failures += shared > limit
        print(
            f"{status:>4} {label:<28} {kernel.fn.__name__:<24} smem {shared:>6} "
            f"warps {warps} stages {stages} {time.perf_counter() - start:5.1f}s  {consts}"
        )
    print(f"{len(seen)} configurations, {failures} failed")
    return 1 if failures else 0
