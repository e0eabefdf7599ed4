"""What EngineConfig.quantization needs of the other settings, checked before any actor starts.

int8 (int8 weights, an fp32 scale per output channel, fp32 activations; on a CPU with
AVX512-VNNI each projection quantizes its input rows to int8 as well) and bf16
(the weights kept in bf16, fp32 activations and arithmetic) run in the CPU fast path's C kernels
(kernels/cpu/panels.py), on a model in float32, whole on one rank. The Worker checks the rest
once it has its device: that it is a CPU and the kernels build there (and, for bf16, that the
checkpoint is bf16 or fp32).
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
