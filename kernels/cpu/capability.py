"""What this CPU does in hardware, for the choices that depend on it: where bf16 runs natively
(the Worker's `dtype auto`, the greedy head's bf16 screen), and where int8 multiplies int8 (the
int8 panels' tile, csrc/cpu_panel_gemm_int8.c, chosen when the library is compiled for this CPU;
this says which the tests and logs expect). One place, so they never disagree.

Read from the Linux kernel's /proc/cpuinfo flags: the kernel lists a feature only where the CPU
has it and the kernel enables it (AMX tiles need its support), which is what a product needs.
Elsewhere (no such file) nothing counts as native, and bf16 is not chosen unless asked for.
"""

from __future__ import annotations

import functools

# The first flag present names the unit: AMX's tile products first (the faster), then AVX-512's.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


# AVX512-VNNI's vpdpbusd: what the int8 panels' int8 x int8 tile is compiled for.
INT8_DOT_FLAG = "avx512_vnni"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's /proc/cpuinfo flags (none where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16_feature() -> str | None:
    """The /proc/cpuinfo flag of this CPU's bf16 arithmetic (BF16_FLAGS), or None without it
    (bf16 products would then be emulated, far slower than fp32)."""
    return next((flag for flag in BF16_FLAGS if flag in cpu_flags()), None)


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 products in hardware (AMX-BF16 or AVX512-BF16)."""
    return cpu_bf16_feature() is not None


def cpu_has_int8_dot() -> bool:
    """Whether this CPU sums int8 x int8 products in int32 in one instruction (AVX512-VNNI):
    the library built for it (-march=native) then multiplies the int8 panels that way."""
    return INT8_DOT_FLAG in cpu_flags()
