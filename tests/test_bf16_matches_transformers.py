"""A bf16 checkpoint served in bf16 (`dtype auto` on a CPU with native bf16) agrees with
transformers running the same checkpoint in bf16, by vLLM's criterion (check_logprobs_close):
both greedy with the top-5 logprobs; where the two token sequences first differ, each side's token
must be in the other's top-5 at that position, and the prompt is compared no further. Exact
equality is not the test in bf16: the two sum in different orders, and a near tie can flip.
Served with `--dtype float32`, the same checkpoint matches transformers in fp32 token for token.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import torch

from actorserve.gateway.client import AsyncClient
from actorserve.kernels.cpu.capability import cpu_has_bf16
from actorserve.messages.common import SamplingParams
from actorserve.weights.checkpoints import ensure_checkpoint
from support import (
    PROMPT_LENGTHS,
    EngineServer,
    generate_concurrently,
    hf_generate,
    hf_greedy,
    prompts_of_lengths,
)

MAX_TOKENS = 48
TOP = 5
GREEDY_TOP5 = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
FP32_GREEDY = SamplingParams(temperature=0.0, max_tokens=24)

needs_bf16_cpu = pytest.mark.skipif(
    not cpu_has_bf16(), reason="this CPU has no AMX-BF16 or AVX512-BF16: auto serves fp32"
)


@functools.cache
def hf_bf16(model_dir: Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return model.to(device).eval()


def hf_greedy_top(
    model_dir: Path, prompt: list[int], device: str = "cpu"
) -> tuple[list[int], list[set[int]]]:
    """Transformers' greedy continuation in bf16 (on `device`) and the top-5 token ids at each
    position (log_softmax of its logits, as the engine reports them)."""
    out = hf_generate(
        hf_bf16(model_dir, device),
        prompt,
        MAX_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    tops = [
        set(torch.log_softmax(step[0].float(), -1).topk(TOP).indices.tolist())
        for step in out.logits
    ]
    return tokens, tops


def engine_greedy_top(address: str, prompts) -> list[tuple[list[int], list[set[int]]]]:
    """The engine's greedy tokens and each position's top-5 ids, every prompt at once."""

    async def run():
        async with AsyncClient(address, timeout_s=300) as client:
            joined = await asyncio.gather(*[client.complete_all(p, GREEDY_TOP5) for p in prompts])
        return [
            (d.token_ids, [{token for token, _ in lp.top} for lp in d.logprobs]) for (d,) in joined
        ]

    return asyncio.run(run())


def identical_prefix(
    model_dir: Path, engine, device: str = "cpu", lengths: list[int] = PROMPT_LENGTHS
) -> list[int]:
    """Check a prompt of each length by the criterion (module docstring) against transformers
    on `device` -> each one's identical prefix. `engine`: what serves at `engine.address` (an
    EngineServer; an offline LLM: scripts/gpu_check.py runs this on CUDA)."""
    prompts = prompts_of_lengths(model_dir, lengths)
    assert len(prompts) == len(lengths) >= 1
    prefixes = []
    for prompt, (ours, our_tops) in zip(prompts, engine_greedy_top(engine.address, prompts)):
        theirs, their_tops = hf_greedy_top(model_dir, prompt, device)
        assert all(len(top) == TOP for top in our_tops)
        same = 0
        while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
            same += 1
        if same < min(len(ours), len(theirs)):
            where = f"prompt of {len(prompt)} tokens, output position {same}"
            assert ours[same] in their_tops[same], f"{where}: ours not in transformers' top-5"
            assert theirs[same] in our_tops[same], f"{where}: transformers' not in our top-5"
        else:  # one stopped (EOS) where the other did too, or both ran to max_tokens
            assert len(ours) == len(theirs), f"prompt of {len(prompt)} tokens: lengths differ"
        prefixes.append(same)
    mean = sum(prefixes) / len(prefixes)
    print(f"\n{model_dir.name}: mean identical prefix {mean:.1f} of {MAX_TOKENS}: {prefixes}")
    return prefixes


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
