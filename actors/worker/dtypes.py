"""The Worker's dtypes: the model's (EngineConfig.dtype) and the KV cache's (kv_cache_dtype),
each with the reason it was chosen, for the log; and under `dtype auto` whether the projections'
weights are kept in bf16 (`auto_quantization`).

`auto` keeps the checkpoint's dtype (config.json's `dtype`, or `torch_dtype` in older exports)
where the device runs it natively: CUDA, or a CPU with bf16 arithmetic (AMX-BF16, AVX512-BF16;
kernels/cpu/capability.py). Elsewhere a bf16 / fp16 checkpoint is upcast to float32, since
emulated half-precision products are far slower than fp32 ones. An fp32 checkpoint stays fp32
everywhere. In bf16, softmax, norms and accumulations still run in fp32 (the model's and the
kernels' own casts, as transformers does). A model quantized (EngineConfig.quantization) runs in
float32: int8 weights, or bf16 ones (`bf16`, from a bf16 or fp32 checkpoint), are widened in the
kernels' registers (kernels/cpu/quantize.py, kernels/cpu/panels.py).

The upcast doubles the bytes a decode step reads (at a few rows it is bound by them), so for a
bf16 checkpoint on a CPU without bf16 arithmetic `auto` also times the CPU fast path's panel
products at decode row counts (kernels/cpu/bf16_weight_rule.py) and, where bf16-weight panels
win at every one, serves quantization bf16: fp32 activations and arithmetic over the
checkpoint's own bf16 weights, the upcast model's results up to the order of the sums. The log
line of that choice carries the times it was made on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec
import torch

from ...kernels.cpu.bf16_weight_rule import PanelTimes, bf16_weights_win
from ...kernels.cpu.capability import cpu_bf16_feature
from ..runtime.quantization import quantization_fits

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Choice(NamedTuple):
    dtype: torch.dtype
    reason: str


class QuantizationChoice(NamedTuple):
    quantization: str  # EngineConfig.quantization to serve with
    reason: str | None  # None: as asked, nothing chosen


def model_dtype(
    asked: str, checkpoint: str | None, device: torch.device, quantization: str = "none"
) -> Choice:
    """EngineConfig.dtype `asked` for a checkpoint stored in `checkpoint` (None: not said, taken
    as float32) on `device`, with EngineConfig.quantization (validated: with int8 or bf16,
    `asked` is auto or float32). ValueError for quantization bf16 of a float16 checkpoint (it
    would round the weights)."""
    if quantization == "bf16" and checkpoint not in (None, "float32", "bfloat16"):
        raise ValueError(
            f"quantization must be none or int8 for a {checkpoint} checkpoint (bf16 keeps a "
            f"bfloat16 or float32 checkpoint's weights in bf16), got {quantization}"
        )
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


def auto_quantization(
    config, checkpoint: str | None, device: torch.device, measure: Callable[[], PanelTimes | None]
) -> QuantizationChoice:
    """The quantization to serve an EngineConfig `config` with: its own, except under dtype
    auto, quantization none, for a bfloat16 checkpoint on a CPU without bf16 arithmetic where
    the settings can run quantization bf16 (the CPU fast path on, one rank): then bf16 where
    `measure()` (bf16_weight_rule.measure on the model's shape; None: no C kernels) says
    bf16-weight panels are faster at every decode row count, else none; the reason gives
    the times."""
    asked = config.quantization
    if (
        asked != "none"
        or config.dtype != "auto"
        or checkpoint != "bfloat16"
        or device.type != "cpu"
        or cpu_bf16_feature() is not None
        or not quantization_fits(msgspec.structs.replace(config, quantization="bf16"))
    ):
        return QuantizationChoice(asked, None)
    times = measure()
    if times is None:
        return QuantizationChoice(asked, None)
    if bf16_weights_win(times):
        return QuantizationChoice(
            "bf16", f"auto: the bf16 checkpoint's weights in bf16-weight panels, fp32 "
            f"activations (faster than fp32 panels at every decode row count: {times.describe()})",
        )  # fmt: skip
    return QuantizationChoice(
        asked, f"auto: fp32 panels (bf16-weight panels not faster at every decode row count: "
        f"{times.describe()})",
    )  # fmt: skip


def kv_cache_dtype(asked: str, model: torch.dtype) -> Choice:
    """EngineConfig.kv_cache_dtype `asked` for a model in `model`."""
    if asked == "auto":
        return Choice(model, "auto: the model's")
    return Choice(TORCH_DTYPES[asked], f"kv_cache_dtype={asked}")
