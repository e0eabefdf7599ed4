"""The Worker's dtypes: the model's (EngineConfig.dtype) and the KV cache's (kv_cache_dtype),
each with the reason it was chosen, for the log.

`auto` keeps the checkpoint's dtype (config.json's `dtype`, or `torch_dtype` in older exports)
where the device runs it natively: CUDA, or a CPU with bf16 arithmetic (AMX-BF16, AVX512-BF16;
kernels/cpu/capability.py). Elsewhere a bf16 / fp16 checkpoint is upcast to float32, since
emulated half-precision products are far slower than fp32 ones. An fp32 checkpoint stays fp32
everywhere. In bf16, softmax, norms and accumulations still run in fp32 (the model's and the
kernels' own casts, as transformers does). A model quantized to int8 (EngineConfig.quantization)
runs in float32: its int8 weights are widened in the kernels' registers (kernels/cpu/quantize.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...kernels.cpu.capability import cpu_bf16_feature

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Choice(NamedTuple):
    dtype: torch.dtype
    reason: str


def model_dtype(
    asked: str, checkpoint: str | None, device: torch.device, quantization: str = "none"
) -> Choice:
    """EngineConfig.dtype `asked` for a checkpoint stored in `checkpoint` (None: not said, taken
    as float32) on `device`, with EngineConfig.quantization (validated: with int8, `asked` is
    auto or float32)."""
    if quantization != "none":
        return Choice(torch.float32, f"quantization={quantization}: fp32 activations")
    if asked != "auto":
        return Choice(TORCH_DTYPES[asked], f"dtype={asked}")
    stored = TORCH_DTYPES.get(checkpoint or "float32", torch.float32)
    if stored == torch.float32:
        return Choice(torch.float32, f"auto: the checkpoint is {checkpoint or 'float32'}")
    if device.type == "cuda":
        return Choice(stored, f"auto: the checkpoint's {checkpoint}, native on CUDA")
    if device.type == "cpu" and stored == torch.bfloat16:
        feature = cpu_bf16_feature()
        if feature is not None:
            return Choice(
                stored, f"auto: the checkpoint's bfloat16, native on this CPU ({feature})"
            )
        return Choice(
            torch.float32, "auto: the checkpoint is bfloat16, this CPU has no AMX-BF16 or "
            "AVX512-BF16 (bf16 products would be emulated): float32",
        )  # fmt: skip
    return Choice(
        torch.float32, f"auto: the checkpoint is {checkpoint}, not native on {device.type}: float32"
    )


def kv_cache_dtype(asked: str, model: torch.dtype) -> Choice:
    """EngineConfig.kv_cache_dtype `asked` for a model in `model`."""
    if asked == "auto":
        return Choice(model, "auto: the model's")
    return Choice(TORCH_DTYPES[asked], f"kv_cache_dtype={asked}")
