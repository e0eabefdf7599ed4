"""Compile the CPU kernels in C (csrc/) into one shared library, cached per user.

Built with the machine's C compiler ($CC, else cc or gcc) on first use into a per-user cache
($ACTORSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/actorserve/kernels), named by a hash of the
sources, the flags, the compiler and the CPU, so a changed file or another machine never loads a
stale library. A new build keeps the KEPT_BUILDS most recently used libraries and removes the
rest: checkouts or versions that share the cache (a developer's worktrees, an upgrade installed
beside a running server) each keep theirs, so a restarted Worker loads its library instead of
compiling it again. The library is linked against the OpenMP runtime that torch already has
loaded (libgomp.so.1 is matched by soname), so the kernels and torch share one thread pool. The
sources are found next to this module, so an editable install and a wheel both build from the
files they ship (pyproject.toml's package-data).

What each source holds: cpu_decode.c and cpu_prefill.c (decode and prefill attention reading the
paged cache directly, with cpu_attention.h), cpu_decode_bf16.c (a decode's work over a bf16
cache: bf16 products, online softmax), cpu_store_kv.c (writing a step's K/V into it),
cpu_argmax.c (greedy sampling's argmax), cpu_panel_gemm.c and cpu_panel_gemm_bf16.c (decode-sized
products against fp32 or bf16 weights packed in panels: the projections, and the LM head with
that argmax fused; their shared loop in cpu_panel.h and cpu_panel_loop.h), cpu_panel_gemm_int8.c
(the same loop over int8 weights with fp32 scales: `quantization int8`; int8 x int8 products in
cpu_panel_int8_dot.h where the build targets AVX512-VNNI, so only the native build on such a CPU
has them and the x86-64-v3 build widens the weights as every other CPU does),
cpu_panel_gemm_bf16_weights.c (over bf16 weights with fp32 rows: `quantization bf16`; the tile it
shares with the int8 one in cpu_panel_widen.h), cpu_elementwise.c
(RMSNorm with its residual add, SiLU-and-multiply, RoPE) and cpu_elementwise_bf16.c (the same
for bf16 tensors, rounding where torch does), cpu_decode_stack.c (a whole decode step
through those kernels in one call), cpu_step_inputs.c (a decode step's flat inputs), cpu_screen.c
and cpu_screen_int8.c (greedy tokens behind a bf16 or an AMX int8 screen); cpu_vec.h and
cpu_kernels.h are shared.

The library serves with -march=native. A test may also build it for another x86 level
(`build("x86-64-v3")`: AVX2 and FMA, no AVX-512) to run the kernels' narrower vector paths on a
CPU that has wider ones; such a build is cached beside the native one under its own name.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "cpu_decode.c",
        "cpu_decode_bf16.c",
        "cpu_prefill.c",
        "cpu_argmax.c",
        "cpu_panel_gemm.c",
        "cpu_panel_gemm_bf16.c",
        "cpu_panel_gemm_int8.c",
        "cpu_panel_gemm_bf16_weights.c",
        "cpu_elementwise.c",
        "cpu_elementwise_bf16.c",
        "cpu_store_kv.c",
        "cpu_decode_stack.c",
        "cpu_step_inputs.c",
        "cpu_screen.c",
        "cpu_screen_int8.c",
    )
)
HEADERS = tuple(
    CSRC / name
    for name in (
        "cpu_vec.h", "cpu_kernels.h", "cpu_attention.h", "cpu_panel.h", "cpu_panel_loop.h",
        "cpu_panel_widen.h", "cpu_panel_int8_dot.h",
    )
)  # fmt: skip
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-lm")
CACHE_ENV = "ACTORSERVE_KERNEL_CACHE"
KEPT_BUILDS = 4


def cache_dir() -> Path:
    """$ACTORSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/actorserve/kernels (~/.cache/...)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "actorserve" / "kernels"


def _cpu_model() -> str:
    """The first CPU's model name and feature flags (they decide what -march=native emits)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(line for line in lines if line.startswith(("model name", "flags")))


def build(march: str = "native") -> Path | None:
    """Compile the sources for `march` (gcc's -march: native, or an x86 level such as x86-64-v3
    for tests) or find them compiled -> the library's path; None without a compiler.

    Raises RuntimeError when the compiler fails."""
    flags = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)
    given = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if given is None or platform.system() != "Linux":
        return None
    compiler = shlex.split(given)  # CC may carry words: "ccache gcc"
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(f.read_text() for f in SOURCES + HEADERS),
                *flags,
                version,
                platform.machine(),
                _cpu_model(),
            ]
        ).encode()
    ).hexdigest()[:16]
    # native: cpu_kernels-<key>.so; another level: cpu_kernels-<march>-<key>.so
    tag = "" if march == "native" else f"{march}-"
    target = cache_dir() / f"cpu_kernels-{tag}{key}.so"
    if target.exists():
        _mark_used(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [*compiler, *map(str, SOURCES), "-o", str(built), *flags]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{given} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    prune(target.parent)
    return target


def _mark_used(library: Path) -> None:
    """Its modification time is its last use, which prune() keeps the most recent of."""
    try:
        os.utime(library)
    except OSError:  # a read-only cache: nothing builds there either
        pass


def prune(directory: Path, keep: int = KEPT_BUILDS) -> None:
    """Remove all but the `keep` most recently used libraries (a process that loaded one keeps
    its mapping)."""
    libraries = []
    for path in directory.glob("cpu_kernels-*.so"):
        try:
            libraries.append((path.stat().st_mtime, path))
        except OSError:  # removed meanwhile by another builder
            continue
    for _, stale in sorted(libraries, reverse=True)[keep:]:
        stale.unlink(missing_ok=True)
