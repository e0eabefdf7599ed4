"""Whole completions (SamplingParams.output_kind = final_only): the engine holds a request's
tokens until it finishes, so its client gets one delta instead of one a step. Text, tokens,
logprobs and finish reason are those of the same request streamed, and transformers' greedy
output; stop strings, aborts and the periodic flush still work."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actorserve.gateway.client import AsyncClient
from actorserve.messages.client import Delta, join
from actorserve.messages.common import OutputKind, SamplingParams
from support import EngineServer, hf_greedy, prompts_of_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def whole(params: SamplingParams) -> SamplingParams:
    return msgspec.structs.replace(params, output_kind=OutputKind.FINAL_ONLY)


def outcome(delta: Delta) -> tuple:
    """What a client reads of a finished request, but for its id and prefix-cache hits."""
    return (
        delta.text,
        delta.token_ids,
        delta.finish_reason,
        delta.prompt_tokens,
        delta.completion_tokens,
    )


def deltas_of(address: str, prompt: list[int], params: SamplingParams) -> list[Delta]:
    async def run():
        async with AsyncClient(address, timeout_s=120) as client:
            return [delta async for delta in client.generate(prompt, params)]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine(llama_dir):
    server = EngineServer(llama_dir, "--final-only-flush-s", "60")  # no flush mid-request
    yield server
    assert server.stop() == 0


def test_a_final_only_request_arrives_as_one_delta_equal_to_the_streamed_output(llama_dir, engine):
    for prompt in prompts_of_lengths(llama_dir, [5, 40, 100]):
        streamed = deltas_of(engine.address, prompt, GREEDY)
        held = deltas_of(engine.address, prompt, whole(GREEDY))
        assert len(streamed) > 1
        assert len(held) == 1
        assert held[0].token_ids == hf_greedy(llama_dir, prompt, 24)
        assert outcome(held[0]) == outcome(join(streamed))


def test_logprobs_and_prompt_logprobs_are_held_with_their_tokens(llama_dir, engine):
    prompt = prompts_of_lengths(llama_dir, [30])[0]
    params = msgspec.structs.replace(GREEDY, logprobs=2, prompt_logprobs=1)
    streamed = join(deltas_of(engine.address, prompt, params))
    (held,) = deltas_of(engine.address, prompt, whole(params))
    assert held.token_ids == streamed.token_ids
    assert [(lp.token_id, lp.rank) for lp in held.logprobs] == [
        (lp.token_id, lp.rank) for lp in streamed.logprobs
    ]
    assert [lp.logprob for lp in held.logprobs] == pytest.approx(
        [lp.logprob for lp in streamed.logprobs], abs=1e-4
    )
    assert len(held.prompt_logprobs) == len(prompt)
    assert held.prompt_logprobs[0] is None
    assert [e.token_id for e in held.prompt_logprobs[1:]] == prompt[1:]


def test_a_stop_string_ends_a_final_only_request_where_it_ends_the_streamed_one(llama_dir, engine):
    prompt = prompts_of_lengths(llama_dir, [12])[0]
    text = join(deltas_of(engine.address, prompt, GREEDY)).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = msgspec.structs.replace(GREEDY, stop=[stop])
    streamed = join(deltas_of(engine.address, prompt, params))
    held = deltas_of(engine.address, prompt, whole(params))
    assert streamed.finish_reason.value == "stop"
    assert stop not in streamed.text and len(streamed.text) < len(text)
    assert outcome(join(held)) == outcome(streamed)


def test_an_abandoned_final_only_request_frees_its_blocks_and_the_others_finish(llama_dir, engine):
    long, short = prompts_of_lengths(llama_dir, [64, 20])
    endless = whole(SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True))

    async def run():
        async with AsyncClient(engine.address, timeout_s=120) as client:
            abandoned = asyncio.create_task(client.complete_all(long, endless))
            await asyncio.sleep(0.5)
            finished = await client.complete_all(short, GREEDY)
            abandoned.cancel()  # the SDK aborts it in the Engine
            with pytest.raises(asyncio.CancelledError):
                await abandoned
            await asyncio.sleep(0.2)  # the abort goes out on a task of its own
            return finished

    (finished,) = asyncio.run(run())
    assert finished.token_ids == hf_greedy(llama_dir, short, 24)
    stats = engine.wait_blocks_free()
    assert stats.blocks_free == stats.blocks_total
    assert stats.num_running == stats.num_waiting == 0


def test_held_output_is_flushed_every_final_only_flush_s_while_the_request_runs(llama_dir):
    server = EngineServer(llama_dir, "--final-only-flush-s", "0")  # every step flushes
    try:
        prompt = prompts_of_lengths(llama_dir, [16])[0]
        held = deltas_of(server.address, prompt, whole(GREEDY))
        assert len(held) > 1
        assert join(held).token_ids == hf_greedy(llama_dir, prompt, 24)
    finally:
        assert server.stop() == 0
