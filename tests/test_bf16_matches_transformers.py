"""A bf16 checkpoint served in bf16 (`dtype auto` on a CPU with native bf16) agrees with
transformers running the same checkpoint in bf16, by vLLM's criterion (check_logprobs_close,
tests/logprobs_support.py): both greedy with the top-5 logprobs; where the two token sequences
first differ, each side's token must be in the other's top-5 at that position, and the prompt is
compared no further. Exact equality is not the test in bf16: the two sum in different orders,
and a near tie can flip.
Served with `--dtype float32`, the same checkpoint matches transformers in fp32 token for token.
"""

from __future__ import annotations

import pytest

from actorserve.kernels.cpu.capability import cpu_has_bf16
from actorserve.messages.common import SamplingParams
from actorserve.weights.checkpoints import ensure_checkpoint
from logprobs_support import MAX_TOKENS, identical_prefix  # noqa: F401 (gpu_check_serving's)
from logprobs_support import hf_model_in as hf_bf16  # noqa: F401 (bf16 by default)
from support import (
    PROMPT_LENGTHS,
    EngineServer,
    generate_concurrently,
    hf_greedy,
    prompts_of_lengths,
)

FP32_GREEDY = SamplingParams(temperature=0.0, max_tokens=24)

needs_bf16_cpu = pytest.mark.skipif(
    not cpu_has_bf16(), reason="this CPU has no AMX-BF16 or AVX512-BF16: auto serves fp32"
)


@needs_bf16_cpu
@pytest.mark.parametrize(
    "kind, flags",
    [
        ("demo-bf16", ()),
        ("demo-bf16", ("--kv-cache-dtype", "float32")),
        ("tiny-qwen3-bf16", ()),
    ],
)
def test_bf16_serving_is_logprobs_close_to_transformers_in_bf16(kind, flags):
    model_dir = ensure_checkpoint(kind)
    server = EngineServer(model_dir, *flags)
    try:
        kv = flags[-1] if flags else "bfloat16"
        assert "dtype torch.bfloat16 (auto: the checkpoint's bfloat16" in server.log()
        assert f"KV cache torch.{kv}" in server.log()
        identical_prefix(model_dir, server)
    finally:
        assert server.stop() == 0


def test_dtype_float32_upcasts_a_bf16_checkpoint_and_matches_transformers_in_fp32():
    model_dir = ensure_checkpoint("demo-bf16")
    server = EngineServer(model_dir, "--dtype", "float32")
    try:
        assert "dtype torch.float32 (dtype=float32); KV cache torch.float32" in server.log()
        prompts = prompts_of_lengths(model_dir, PROMPT_LENGTHS)
        results = generate_concurrently(server.address, prompts, FP32_GREEDY)
        for prompt, (_, ids, _) in zip(prompts, results):
            expected = hf_greedy(model_dir, prompt, FP32_GREEDY.max_tokens)
            assert ids == expected, f"prompt of {len(prompt)} tokens diverged"
    finally:
        assert server.stop() == 0
