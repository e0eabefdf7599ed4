"""How many kernels Triton has compiled for each of actorserve's Triton functions in this process:
the count the issue bounds (a compile while serving is a stall), read by scripts/gpu_check.py
after its decode sweep and by scripts/bench_kernels.py after its grid."""

from __future__ import annotations

import sys


def compiled_variants() -> dict[str, int]:
    """Compiled kernels of each Triton function of actorserve.kernels loaded in this process
    (its JIT caches, summed over devices); none under TRITON_INTERPRET."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    counts, seen = {}, set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("actorserve.kernels") or module is None:
            continue
        for value in list(vars(module).values()):
            fn = value
            while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
                fn = fn.fn  # an Autotuner or Heuristics around the JITFunction
            if not isinstance(fn, JITFunction) or id(fn) in seen:
                continue
            seen.add(id(fn))
            caches = getattr(fn, "device_caches", None)
            if caches is not None:
                count = sum(len(entry[0]) for entry in caches.values())
            else:
                count = sum(len(c) for c in getattr(fn, "cache", {}).values())
            counts[f"{fn.fn.__module__}.{fn.fn.__name__}"] = count
    return counts
