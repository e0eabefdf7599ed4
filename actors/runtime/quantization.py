"""What EngineConfig.quantization needs of the other settings, checked before any actor starts.

int8 (weight-only: int8 weights, an fp32 scale per output channel, fp32 activations) runs in the
CPU fast path's C kernels (kernels/cpu/panels.py), on a model in float32, whole on one rank. The
Worker checks the rest once it has its device: that it is a CPU and the kernels build there.
"""

from __future__ import annotations

QUANTIZATION_NEEDS = (
    "none unless the CPU fast path runs the model in float32 (cpu_fast_path on, dtype auto or "
    "float32, tensor_parallel_size 1, a device other than cuda)"
)


def quantization_fits(config) -> bool:
    """Whether `config` (an EngineConfig) can run its quantization, as far as its settings say."""
    if config.quantization == "none":
        return True
    on_cpu = config.device != "cuda" and not config.device.startswith("cuda:")
    return (
        on_cpu
        and config.cpu_fast_path
        and config.tensor_parallel_size == 1
        and config.dtype in ("auto", "float32")
    )
