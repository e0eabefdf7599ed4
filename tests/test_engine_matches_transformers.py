"""The engine's greedy output equals Hugging Face transformers', token for token (fp32, CPU):
with many requests batched, under preemption, with prompts prefilled in chunks (by the step's
budget, or cut to a few tokens beside decodes), and with steps
planned while the step before them runs (async scheduling, the default) or one after another."""

from __future__ import annotations

import asyncio

import pytest

from actorserve import AsyncClient
from actorserve.messages.common import SamplingParams
from support import (
    PROMPT_LENGTHS,
    EngineServer,
    generate_concurrently,
    hf_greedy,
    prompts_of_lengths,
)

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def llama_engine(llama_dir):
    server = EngineServer(llama_dir)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_dir):
    server = EngineServer(qwen3_dir)
    yield server
    assert server.stop() == 0


def assert_matches_transformers(model_dir, address):
    prompts = prompts_of_lengths(model_dir)
    results = generate_concurrently(address, prompts, GREEDY)
    for prompt, (_, ids, last) in zip(prompts, results):
        expected = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert last.finish_reason.value in ("stop", "length")
        assert last.prompt_tokens == len(prompt) and last.completion_tokens == len(ids)


def test_sixteen_concurrent_prompts_match_transformers_on_llama(llama_dir, llama_engine):
    assert len(PROMPT_LENGTHS) >= 16 and min(PROMPT_LENGTHS) == 1 and max(PROMPT_LENGTHS) == 500
    assert_matches_transformers(llama_dir, llama_engine.address)
    assert llama_engine.wait_blocks_free().num_overlapped_steps > 0  # steps planned ahead


def test_output_matches_transformers_with_steps_planned_one_after_another(llama_dir):
    server = EngineServer(llama_dir, "--async-scheduling", "false")
    try:
        assert_matches_transformers(llama_dir, server.address)
        stats = server.wait_blocks_free()
        assert stats.num_overlapped_steps == 0 and stats.num_steps > 0
    finally:
        assert server.stop() == 0


def test_sixteen_concurrent_prompts_match_transformers_on_qwen3(qwen3_dir, qwen3_engine):
    assert_matches_transformers(qwen3_dir, qwen3_engine.address)


def test_output_matches_transformers_when_requests_get_preempted(llama_dir):
    # 48 blocks x 16 = 768 tokens: one 500-token prompt fits, the sixteen together do not.
    server = EngineServer(llama_dir, "--num-kv-blocks", "48", "--max-model-len", "768")
    try:
        assert_matches_transformers(llama_dir, server.address)
        stats = server.wait_blocks_free()
        assert stats.num_preemptions > 0
        assert stats.blocks_free == stats.blocks_total == 48
    finally:
        assert server.stop() == 0


def test_output_matches_transformers_when_long_prompts_are_prefilled_in_chunks(llama_dir):
    # A 64-token step budget: every prompt over 64 tokens is prefilled over several steps.
    server = EngineServer(llama_dir, "--max-num-batched-tokens", "64")
    try:
        assert_matches_transformers(llama_dir, server.address)
        stats = server.wait_blocks_free()
        assert stats.num_partial_prefills >= sum(1 for n in PROMPT_LENGTHS if n > 64)
    finally:
        assert server.stop() == 0


def test_output_matches_transformers_when_prompts_beside_decodes_are_cut_to_a_few_tokens(
    llama_dir,
):
    # One request decodes while the sixteen prompts come in, so the steps that take them have a
    # decode, and such a step computes at most 16 prompt tokens: every prompt over 16 tokens is
    # prefilled 16 tokens a step beside the decodes. (Sixteen prompts alone arriving at once
    # would all fit the first step, which has no decode, and nothing would be cut.)
    server = EngineServer(llama_dir, "--max-prefill-tokens-beside-decodes", "16")
    decoding = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def while_one_decodes() -> None:
        async with AsyncClient(server.address, timeout_s=120) as client:
            stream = client.generate(prompts_of_lengths(llama_dir, [9])[0], decoding)
            await anext(stream)  # it has its first token: it decodes from now on
            await asyncio.to_thread(assert_matches_transformers, llama_dir, server.address)
            await stream.aclose()  # aborts it

    try:
        asyncio.run(while_one_decodes())
        stats = server.wait_blocks_free()
        assert stats.num_partial_prefills >= sum(1 for n in PROMPT_LENGTHS if n > 16)
    finally:
        assert server.stop() == 0
