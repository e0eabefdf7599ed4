"""Scheduling depth through the real processes: prefix caching, swap preemption, chunked prefill
that keeps decodes flowing, and priorities. Greedy output still equals transformers'."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.gateway.client import AsyncClient
from actorserve.messages.common import SamplingParams
from support import EngineServer, generate_concurrently, hf_greedy, prompts_of_lengths

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(llama_dir):
    server = EngineServer(llama_dir, "--max-num-seqs", "8")
    yield server
    assert server.stop() == 0


def test_shared_system_prompt_hits_the_prefix_cache_and_output_still_matches(llama_dir, engine):
    system = prompts_of_lengths(llama_dir, [200])[0]
    tails = prompts_of_lengths(llama_dir, [3, 17, 40, 9, 64, 1])
    prompts = [system + tail for tail in tails]
    before = engine.client.health().stats
    first = generate_concurrently(engine.address, prompts[:1], GREEDY)
    rest = generate_concurrently(engine.address, prompts[1:], GREEDY)
    for prompt, (_, ids, _) in zip(prompts, first + rest):
        assert ids == hf_greedy(llama_dir, prompt, MAX_TOKENS)
    assert first[0][2].cached_tokens == 0
    for _, _, last in rest:
        assert last.cached_tokens == 192  # the 200-token system prompt's 12 full blocks
    after = engine.wait_blocks_free()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 5 * 192


def test_the_same_prompt_twice_reuses_all_but_the_last_token_and_matches(llama_dir, engine):
    prompt = prompts_of_lengths(llama_dir, [161])[0]
    ((_, first, a),) = generate_concurrently(engine.address, [prompt], GREEDY)
    ((_, second, b),) = generate_concurrently(engine.address, [prompt], GREEDY)
    assert first == second == hf_greedy(llama_dir, prompt, MAX_TOKENS)
    assert b.cached_tokens == 160  # 10 full blocks; the last token is recomputed for logits
    exact = prompts_of_lengths(llama_dir, [160])[0]
    generate_concurrently(engine.address, [exact], GREEDY)
    ((_, again, c),) = generate_concurrently(engine.address, [exact], GREEDY)
    assert c.cached_tokens == 144  # a whole-block prompt still recomputes its last block
    assert again == hf_greedy(llama_dir, exact, MAX_TOKENS)


def test_swap_preemption_moves_kv_to_cpu_and_output_matches(llama_dir):
    server = EngineServer(
        llama_dir,
        "--num-kv-blocks",
        "48",
        "--max-model-len",
        "768",
        "--preemption-mode",
        "swap",
        "--enable-prefix-caching",
        "false",
    )
    # 16 prompts of 1994 tokens in all against 768 tokens of cache, each growing by 6 blocks:
    # however they arrive, the running ones outgrow the free blocks and some are swapped out
    long_outputs = SamplingParams(temperature=0.0, max_tokens=96)
    try:
        prompts = prompts_of_lengths(llama_dir)
        results = generate_concurrently(server.address, prompts, long_outputs)
        for prompt, (_, ids, _) in zip(prompts, results):
            assert ids == hf_greedy(llama_dir, prompt, 96)
        stats = server.wait_blocks_free()
        assert stats.num_swaps > 0 and stats.blocks_free == stats.blocks_total
    finally:
        assert server.stop() == 0


def test_a_long_prompt_never_stalls_running_decodes(llama_dir):
    # Budget 32 tokens a step: a 1500-token prompt needs 47 steps of prefill. Decodes go first
    # in every step, so a stream already running gets one token per step all along.
    server = EngineServer(llama_dir, "--max-num-batched-tokens", "32", "--max-num-seqs", "8")
    try:
        long_prompt = prompts_of_lengths(llama_dir, [1500])[0]
        short = prompts_of_lengths(llama_dir, [10])[0]

        async def run():
            async with AsyncClient(server.address, timeout_s=60) as client:
                order = []

                async def stream(prompt, name, max_tokens):
                    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                    async for delta in client.generate(prompt, params):
                        order.extend([name] * len(delta.token_ids))

                decode = asyncio.create_task(stream(short, "decode", 30))
                while not order:
                    await asyncio.sleep(0.01)
                await asyncio.gather(decode, stream(long_prompt, "long", 1))
                return order

        order = asyncio.run(run())
        # The decode finished all 30 tokens before the long prompt's prefill produced its token.
        assert order == ["decode"] * 30 + ["long"]
        stats = server.wait_blocks_free()
        assert stats.num_partial_prefills >= 1500 // 32 - 1
    finally:
        assert server.stop() == 0


def test_a_high_priority_request_is_not_starved_by_a_flood_of_low_priority_work(llama_dir):
    server = EngineServer(llama_dir, "--max-num-seqs", "4")
    try:
        prompts = prompts_of_lengths(llama_dir, [30] * 12 + [25])

        async def run():
            async with AsyncClient(server.address, timeout_s=60) as client:
                done, started = [], asyncio.Event()

                async def stream(prompt, name, priority, max_tokens):
                    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                    async for delta in client.generate(prompt, params, priority=priority):
                        started.set()
                        if delta.finished:
                            done.append(name)

                flood = [
                    asyncio.create_task(stream(p, f"low{i}", 5, 150))
                    for i, p in enumerate(prompts[:12])
                ]
                await started.wait()  # four low-priority requests hold every seat
                await asyncio.gather(stream(prompts[12], "high", 0, 20), *flood)
                return done

        done = asyncio.run(run())
        # Only 4 seats: without priorities "high" would wait for 12 low-priority requests.
        assert done.index("high") <= 1, done
        stats = server.wait_blocks_free()
        assert stats.num_preemptions >= 1  # it took a running low-priority request's seat
    finally:
        assert server.stop() == 0


def test_steady_decoding_asks_the_block_manager_about_once_a_block_and_still_matches(
    llama_dir, engine
):
    prompts = prompts_of_lengths(llama_dir, [30, 7, 55, 16])
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    before = engine.client.health().stats
    results = generate_concurrently(engine.address, prompts, params)
    after = engine.wait_blocks_free()
    for prompt, (_, ids, _) in zip(prompts, results):
        assert ids == hf_greedy(llama_dir, prompt, 160)
    steps = after.num_steps - before.num_steps
    trips = after.num_block_round_trips - before.num_block_round_trips
    assert steps >= 160
    # every step asked before (steps == trips); now a request asks for a block of 16 tokens of
    # room whenever it needs a block, so one round trip serves about 16 steps
    assert trips <= steps // 8


def test_the_stats_carry_a_fit_of_the_steps_the_engine_ran(llama_dir, engine):
    """Every step that computed something is one the fit of its step time has seen (for the
    gateways' kv_events routing: gateway/kv_routing.py)."""
    prompts = prompts_of_lengths(llama_dir, [90, 12, 33])
    before = engine.client.health().stats
    generate_concurrently(engine.address, prompts, GREEDY)
    after = engine.wait_blocks_free()
    cost = after.step_cost
    assert cost is not None and cost.token_budget == 2048
    assert cost.steps - before.step_cost.steps == after.num_steps - before.num_steps > 0
    assert cost.prefill_token_s >= 0.0 and cost.decode_row_s >= 0.0 and cost.step_s >= 0.0
    assert cost.step_s + cost.prefill_token_s + cost.decode_row_s > 0.0
