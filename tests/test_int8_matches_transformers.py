"""`--quantization int8` (weight-only int8 projections, fp32 activations: kernels/cpu/quantize.py)
served on CPU agrees with transformers running the same checkpoint in fp32, by vLLM's
logprobs-close criterion (tests/logprobs_support.py): greedy with the top-5 logprobs, and where
the two sequences first differ, each side's token is in the other's top-5. Quantizing moves every
logit a little, so a near tie may flip where fp32 alone would match token for token. Settings
that cannot run int8 are refused before the engine serves, naming the field."""

from __future__ import annotations

import pytest
import torch

from actorserve.weights.checkpoints import ensure_checkpoint
from logprobs_support import identical_prefix
from support import EngineServer


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-qwen3", "demo"])
def test_int8_serving_is_logprobs_close_to_transformers_in_fp32(kind):
    model_dir = ensure_checkpoint(kind)
    server = EngineServer(model_dir, "--quantization", "int8")
    try:
        log = server.log()
        assert "dtype torch.float32 (quantization=int8: fp32 activations)" in log
        assert "projections in int8 panels, 0 with a bias kept as loaded" in log
        identical_prefix(model_dir, server, dtype=torch.float32)
    finally:
        assert server.stop() == 0


def test_int8_with_a_bf16_dtype_is_refused_naming_the_field():
    with pytest.raises(RuntimeError, match="quantization must be none unless the CPU fast path"):
        EngineServer(
            ensure_checkpoint("tiny-llama"), "--quantization", "int8", "--dtype", "bfloat16"
        )
