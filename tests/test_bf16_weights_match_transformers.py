"""`--quantization bf16` (a bf16 checkpoint's projections kept in bf16 panels, fp32 activations
and arithmetic: what `dtype auto` picks on a CPU without bf16 arithmetic where it is faster)
served on CPU equals transformers running the checkpoint upcast to fp32, token for token: the
widened weights are the upcast model's, so only the order of fp32 sums differs, as for the fp32
fast path. A setting that cannot run it is refused before the engine serves, naming the
field."""

from __future__ import annotations

import pytest

from actorserve.messages.common import SamplingParams
from actorserve.weights.checkpoints import ensure_checkpoint
from support import EngineServer, generate_concurrently, hf_greedy, prompts_of_lengths

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("kind", ["demo-bf16", "tiny-qwen3-bf16"])
def test_bf16_weight_serving_matches_transformers_in_fp32(kind):
    model_dir = ensure_checkpoint(kind)
    server = EngineServer(model_dir, "--quantization", "bf16")
    try:
        log = server.log()
        assert "dtype torch.float32 (quantization=bf16: fp32 activations)" in log
        assert "projections in bf16-weight panels, 0 with a bias kept as loaded" in log
        prompts = prompts_of_lengths(model_dir)
        results = generate_concurrently(server.address, prompts, GREEDY)
        for prompt, (_, ids, _) in zip(prompts, results, strict=True):
            expected = hf_greedy(model_dir, prompt, MAX_TOKENS)
            assert ids == expected, f"prompt of {len(prompt)} tokens diverged"
    finally:
        assert server.stop() == 0


def test_bf16_weights_with_a_bf16_dtype_are_refused_naming_the_field():
    with pytest.raises(RuntimeError, match="quantization must be none unless the CPU fast path"):
        EngineServer(
            ensure_checkpoint("demo-bf16"), "--quantization", "bf16", "--dtype", "bfloat16"
        )
