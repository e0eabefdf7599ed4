"""Sampling completeness: penalties and logit_bias against a small reference implementation,
logprobs and prompt logprobs against transformers' log_softmax, n > 1 parallel samples; through
the processors alone, then through the real processes (SDK and OpenAI routes).

One server (small token budget, so prompts are prefilled in chunks) serves every end-to-end test.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import openai
import pytest
import torch
from gateway_support import GatewayServer
from websockets.asyncio.client import connect

from actorserve.actors.worker.logits_processors import apply_logits_processors
from actorserve.actors.worker.logprobs import start_sample_logprobs
from actorserve.actors.worker.sample_row import SampleRow
from actorserve.actors.worker.sampler import Sampler
from actorserve.gateway.client import AsyncClient
from actorserve.messages.common import SamplingParams
from support import hf_greedy, hf_model, prompts_of_lengths

ATOL = 1e-4


def reference_logits(logits, prompt, output, params: SamplingParams):
    """One row, token by token: logit_bias, then repetition, frequency and presence penalties."""
    out = logits.clone()
    for token, bias in params.logit_bias.items():
        out[token] += bias
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out


def random_case(generator, vocab: int):
    prompt = torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=generator)),))
    output = torch.randint(0, vocab // 4, (int(torch.randint(0, 40, (1,), generator=generator)),))
    return prompt.tolist(), output.tolist()


PARAMS = [
    SamplingParams(),  # untouched
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5),
    SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0),
    SamplingParams(logit_bias={3: 100.0, 7: -100.0, 11: 2.5}),
    SamplingParams(
        presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.3, logit_bias={0: -5}
    ),
]


def test_penalties_and_logit_bias_match_the_reference_row_by_row():
    generator = torch.Generator().manual_seed(0)
    vocab = 64
    for trial in range(5):
        logits = torch.randn(len(PARAMS), vocab, generator=generator) * 3
        cases = [random_case(generator, vocab) for _ in PARAMS]
        expected = torch.stack(
            [
                reference_logits(logits[i], prompt, output, p)
                for i, (p, (prompt, output)) in enumerate(zip(PARAMS, cases))
            ]
        )
        extra = [9, 9] if trial % 2 else []  # token_ids past `position` are ignored
        for temperature in (1.0, 0.0):
            rows = [
                SampleRow(
                    msgspec.structs.replace(p, temperature=temperature),
                    len(prompt) + len(output),
                    len(output),
                    [],
                    prompt + output + extra,
                )
                for p, (prompt, output) in zip(PARAMS, cases)
            ]
            if temperature:
                got = apply_logits_processors(logits.clone(), rows)
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
            else:  # the greedy sampler takes the argmax of the processed logits
                assert Sampler()(logits.clone(), rows) == expected.argmax(-1).tolist()


def test_penalties_follow_a_row_from_step_to_step():
    """The runner reuses a request's SampleRow every step, appending what it samples; the
    penalties count only the new tokens each time and still match the reference."""
    generator = torch.Generator().manual_seed(1)
    vocab = 64
    params = PARAMS[-1]  # every penalty and a bias
    prompt, output = random_case(generator, vocab)
    tokens = prompt + output[:3]
    row = SampleRow(params, len(tokens), 3, [], tokens)
    for step in range(3, len(output) + 1):
        row.position, row.num_output = len(prompt) + step, step
        logits = torch.randn(1, vocab, generator=generator) * 3
        expected = reference_logits(logits[0], prompt, output[:step], params)
        got = apply_logits_processors(logits.clone(), [row])[0]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5, msg=f"step {step}")
        tokens.extend(output[step : step + 1])  # the runner appends the sampled token
    history = row.penalty_history
    assert history is not None and history.num_counted == len(output)


def test_sample_logprobs_are_the_raw_log_softmax_with_ranks_and_top_k():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    rows = [
        SampleRow(SamplingParams(temperature=0.0, logprobs=3), 5, 0, []),
        SampleRow(SamplingParams(temperature=0.0), 5, 0, []),  # asks for none
        SampleRow(SamplingParams(temperature=0.0, logprobs=0, logit_bias={7: 100.0}), 5, 0, []),
        SampleRow(SamplingParams(temperature=1.0, seed=3, logprobs=20), 5, 0, []),
    ]
    raw = torch.log_softmax(logits, -1)
    pending = start_sample_logprobs(logits, rows)
    tokens = Sampler()(logits, rows)
    assert tokens[2] == 7  # the bias decided the token ...
    entries = pending.finish(tokens)
    assert entries[1] is None
    for i in (0, 2, 3):
        entry, token = entries[i], tokens[i]
        assert entry.token_id == token
        assert abs(entry.logprob - raw[i, token].item()) < 1e-6  # ... but not its logprob
        assert entry.rank == 1 + int((raw[i] > raw[i, token]).sum())
        k = rows[i].params.logprobs
        values, ids = raw[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-6)


# -- through the real processes ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir):
    server = GatewayServer(
        llama_dir, "--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"
    )
    yield server
    assert server.stop() == 0


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: transformers' log_softmax at every position of `ids`."""
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def assert_entry_matches(entry, reference: torch.Tensor, token: int, k: int):
    """One TokenLogprobs against transformers' logprobs row `reference` [vocab]."""
    assert entry.token_id == token
    assert abs(entry.logprob - reference[token].item()) < ATOL
    lo = 1 + int((reference > reference[token] + ATOL).sum())
    hi = 1 + int((reference > reference[token] - ATOL).sum())
    assert lo <= entry.rank <= hi
    values, ids = reference.topk(k)
    assert len(entry.top) == k
    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=ATOL)
    assert [t for t, _ in entry.top][:1] == ids.tolist()[:1]


def test_n4_with_a_seed_gives_four_distinct_reproducible_samples_sharing_the_prompt(
    llama_dir, server
):
    prompt = prompts_of_lengths(llama_dir, [40])[0]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    before = server.client.health().stats
    samples = server.client.complete_all(prompt, params)
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert all(s.finish_reason.value == "length" and len(s.token_ids) == 12 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) == 4
    after = server.client.health().stats
    # Samples 1-3 forked sample 0's prompt KV (its partial third block copied on write) and
    # recomputed only the last prompt token.
    assert after.num_forks - before.num_forks == 3
    assert [s.cached_tokens for s in samples[1:]] == [39, 39, 39]
    again = server.client.complete_all(prompt, params)
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]
    assert [s.text for s in again] == [s.text for s in samples]
    third = SamplingParams(temperature=1.0, seed=13, max_tokens=12, ignore_eos=True)
    assert server.client.complete(prompt, third).token_ids == samples[2].token_ids


def test_aborting_an_n_request_aborts_every_sample(llama_dir, server):
    async def run():
        async with AsyncClient(server.address, timeout_s=60) as client:
            params = SamplingParams(n=3, temperature=1.0, max_tokens=400, ignore_eos=True)
            seen = []
            async for delta in client.generate("def f(x):", params, request_id="many"):
                seen.append(delta)
                if len(seen) == 4:
                    await client.abort("many")
            return seen

    seen = asyncio.run(run())
    ends = {d.index: d.finish_reason.value for d in seen if d.finished}
    assert ends == {0: "abort", 1: "abort", 2: "abort"}
    stats = server.wait_blocks_free()
    assert stats.num_running == 0 and stats.blocks_free == stats.blocks_total


def test_penalised_greedy_equals_a_reference_loop_over_transformers_logits(llama_dir, server):
    prompt = prompts_of_lengths(llama_dir, [20])[0]
    plain = server.client.complete(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1.5,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={plain.token_ids[0]: -100.0, 5: 3.0},
    )
    got = server.client.complete(prompt, params).token_ids
    ids = list(prompt)
    for _ in range(16):
        with torch.inference_mode():
            logits = hf_model(llama_dir)(torch.tensor([ids])).logits[0, -1].float()
        output = ids[len(prompt) :]
        ids.append(int(reference_logits(logits, prompt, output, params).argmax()))
    assert got == ids[len(prompt) :]
    assert plain.token_ids[0] not in got  # banned by its bias


def test_a_step_mixing_plain_greedy_rows_with_others_gives_each_its_own_tokens(llama_dir, server):
    """Plain greedy rows take their tokens from the fused LM head, the others from the logits:
    in one batch each request gets what it gets alone, and the greedy ones transformers'."""
    prompts = prompts_of_lengths(llama_dir, [12, 30, 18, 25])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kinds = [
        greedy,
        msgspec.structs.replace(greedy, repetition_penalty=1.5, frequency_penalty=0.4),
        msgspec.structs.replace(greedy, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
    ]
    alone = [server.client.complete(p, k) for p, k in zip(prompts, kinds)]

    async def batch():
        async with AsyncClient(server.address, timeout_s=60) as client:
            return await asyncio.gather(
                *(client.complete_all(p, k) for p, k in zip(prompts, kinds))
            )

    together = [samples[0] for samples in asyncio.run(batch())]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert together[0].token_ids == hf_greedy(llama_dir, prompts[0], 12)
    assert together[2].token_ids == hf_greedy(llama_dir, prompts[2], 12)
    assert [e.token_id for e in together[2].logprobs] == together[2].token_ids
    assert together[0].logprobs is None and together[1].logprobs is None  # none asked


def test_logprobs_of_greedy_tokens_and_of_the_prompt_match_transformers(llama_dir, server):
    prompt = prompts_of_lengths(llama_dir, [150])[0]  # three prefill chunks of <= 64 tokens
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3)
    result = server.client.complete(prompt, params)
    reference = hf_logprobs(llama_dir, prompt + result.token_ids)
    assert len(result.logprobs) == len(result.token_ids) == 8
    for i, (entry, token) in enumerate(zip(result.logprobs, result.token_ids)):
        assert_entry_matches(entry, reference[len(prompt) - 1 + i], token, 5)
        assert entry.rank == 1  # greedy: the most likely token
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        assert_entry_matches(result.prompt_logprobs[j], reference[j - 1], prompt[j], 3)
    again = server.client.complete(prompt, params)  # no prefix-cache hits for prompt logprobs
    assert again.cached_tokens == 0
    assert again.prompt_logprobs == result.prompt_logprobs


def test_openai_routes_return_logprobs_and_n_choices(llama_dir, server):
    greedy = server.client.complete(
        "def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    )
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        result = client.completions.create(
            model=server.model_name,
            prompt="def fibonacci(n):",
            max_tokens=6,
            temperature=0,
            logprobs=2,
            n=2,
        )
        assert [c.index for c in result.choices] == [0, 1]
        for choice in result.choices:
            assert choice.text == greedy.text
            lp = choice.logprobs
            assert len(lp.tokens) == 6 and lp.text_offset[0] == 0
            expected = [e.logprob for e in greedy.logprobs]
            assert lp.token_logprobs == pytest.approx(expected, abs=ATOL)  # batched: not bitwise
            assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
        assert result.usage.completion_tokens == 12

        chunks = list(
            client.chat.completions.create(
                model=server.model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                n=2,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        by_index: dict[int, list] = {0: [], 1: []}
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    by_index[choice.index].extend(choice.logprobs.content)
        assert [len(v) for v in by_index.values()] == [5, 5]
        assert all(len(t.top_logprobs) == 2 and t.bytes is not None for t in by_index[0])
        assert chunks[-1].usage.completion_tokens == 10

        extra = client.completions.create(
            model=server.model_name,
            prompt="def fibonacci(n):",
            max_tokens=2,
            temperature=0,
            extra_body={"prompt_logprobs": 1},
        )
        prompt_lps = extra.choices[0].model_extra["prompt_logprobs"]
        assert prompt_lps[0] is None and len(prompt_lps) == greedy.prompt_tokens
        assert all({"logprob", "rank", "decoded_token"} <= set(v) for v in prompt_lps[1].values())


def test_websocket_passes_n_logprobs_and_logit_bias_through(server):
    params = {"n": 2, "temperature": 0, "max_tokens": 4, "ignore_eos": True, "logprobs": 1}
    params["logit_bias"] = {"5": 100}  # JSON keys are strings: token 5 every time
    frame = {"type": "generate", "id": "w", "prompt": "def f():", "params": params}

    async def run() -> list[dict]:
        url = server.url.replace("http://", "ws://") + "/v1/stream"
        async with connect(url) as ws:
            await ws.send(json.dumps(frame))
            frames = []
            while sum(f["type"] == "done" for f in frames) < 2:
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return frames

    frames = asyncio.run(run())
    assert all(f["type"] in ("delta", "done") and f["id"] == "w" for f in frames)
    for index in (0, 1):
        deltas = [f for f in frames if f["type"] == "delta" and f["index"] == index]
        assert [t for d in deltas for t in d["token_ids"]] == [5, 5, 5, 5]
        entries = [e for d in deltas for e in d["logprobs"]]
        assert [e[0] for e in entries] == [5, 5, 5, 5] and all(len(e[3]) == 1 for e in entries)
    assert sorted(f["index"] for f in frames if f["type"] == "done") == [0, 1]


def test_greedy_forked_samples_all_equal_transformers(llama_dir, server):
    from support import hf_greedy

    prompt = prompts_of_lengths(llama_dir, [45])[0]
    samples = server.client.complete_all(
        prompt, SamplingParams(n=3, temperature=0.0, max_tokens=16)
    )
    expected = hf_greedy(llama_dir, prompt, 16)
    assert [s.token_ids for s in samples] == [expected] * 3
