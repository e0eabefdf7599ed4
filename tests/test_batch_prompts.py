"""A batch of prompts on /v1/completions (issue 36), through the official openai SDK: each prompt
is its own request in the Engine, answered as one completion whose choice `index` is
prompt * n + sample, streamed too; usage sums the prompts'; echo + logprobs scoring works per
prompt; one prompt's error fails the call and a client that leaves aborts every prompt.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import openai
import pytest
from gateway_support import API_KEY, AUTH, call, open_stream, read_events, shared_gateway

from support import tokenizer

PROMPTS = ["def add(a, b):", "import os\n", "class Point:"]
N = 2
SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": 8}  # sample j: seed + j, per prompt


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)


def test_choices_are_indexed_prompt_times_n_plus_sample_each_as_its_own_request(gateway):
    with sdk(gateway) as client:
        batch = client.completions.create(model=gateway.model_name, prompt=PROMPTS, n=N, **SAMPLED)
        singles = [
            client.completions.create(model=gateway.model_name, prompt=p, n=N, **SAMPLED)
            for p in PROMPTS
        ]
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS) * N))
    for i, single in enumerate(singles):
        for j, alone in enumerate(single.choices):
            together = batch.choices[i * N + j]
            assert (together.text, together.finish_reason) == (alone.text, alone.finish_reason)
    assert len({c.text for c in batch.choices}) > len(PROMPTS)  # the samples differ: seed + j
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_a_streamed_batch_names_each_chunks_index_and_sums_usage_at_the_end(gateway):
    with sdk(gateway) as client:
        whole = client.completions.create(model=gateway.model_name, prompt=PROMPTS, n=N, **SAMPLED)
        stream = client.completions.create(
            model=gateway.model_name, prompt=PROMPTS, n=N, stream=True,
            stream_options={"include_usage": True}, **SAMPLED,
        )  # fmt: skip
        texts, reasons, usage = defaultdict(str), {}, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage


def test_token_id_batches_and_one_token_list_are_prompts_too(llama_dir, gateway):
    ids = [tokenizer(llama_dir).encode(p, add_special_tokens=False) for p in PROMPTS]
    with sdk(gateway) as client:
        batch = client.completions.create(model=gateway.model_name, prompt=ids, **SAMPLED)
        one = client.completions.create(model=gateway.model_name, prompt=ids[1], **SAMPLED)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert batch.choices[1].text == one.choices[0].text
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)


def test_echo_and_logprobs_score_each_prompt_of_a_batch_as_alone(llama_dir, gateway):
    ids = [tokenizer(llama_dir).encode(p, add_special_tokens=False) for p in PROMPTS]
    score = {"echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0.0}
    with sdk(gateway) as client:
        batch = client.completions.create(model=gateway.model_name, prompt=ids, **score)
        singles = [
            client.completions.create(model=gateway.model_name, prompt=i, **score) for i in ids
        ]
    for together, single in zip(batch.choices, singles):
        alone = single.choices[0]
        assert together.text == alone.text and together.logprobs.tokens == alone.logprobs.tokens
        assert together.logprobs.token_logprobs[0] is None  # nothing predicts the first token
        assert together.logprobs.token_logprobs[1:] == pytest.approx(
            alone.logprobs.token_logprobs[1:], abs=1e-4
        )
        assert together.finish_reason == "length"
    assert batch.usage.completion_tokens == 0


def test_a_streamed_scoring_batch_sends_each_prompt_as_its_choices_first_chunk(gateway):
    body = {"model": gateway.model_name, "prompt": PROMPTS, "echo": True, "max_tokens": 2,
            "temperature": 0.0, "stream": True}  # fmt: skip
    conn, response = open_stream(gateway, "/v1/completions", body, AUTH)
    try:
        events = [json.loads(e) for e in read_events(response) if e != "[DONE]"]
    finally:
        conn.close()
    firsts = {}
    for event in events:
        for choice in event["choices"]:
            firsts.setdefault(choice["index"], choice["text"])
    assert firsts == dict(enumerate(PROMPTS))


def test_one_prompts_error_fails_the_whole_call_naming_it(gateway):
    body = {"model": gateway.model_name, "prompt": ["fine", [5] * 600], "max_tokens": 300}
    for stream in (False, True):
        reply = call(gateway, "POST", "/v1/completions", {**body, "stream": stream}, AUTH)
        assert reply.status == 400, reply.body
        error = reply.json()["error"]
        assert error["message"].startswith("prompt[1]: ") and "max_model_len" in error["message"]
        assert error["param"] == "prompt"
    gateway.wait_blocks_free()  # prompt 0 was aborted (the autouse check: no block leaked)


def running_and_generated(gateway) -> tuple[int, int]:
    stats = gateway.client.health().stats
    return stats.num_running + stats.num_waiting, stats.generation_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_every_prompt_of_its_batch(gateway, stream):
    long = {"max_tokens": 480, "ignore_eos": True, "temperature": 0.0}
    body = {"model": gateway.model_name, "prompt": PROMPTS, "stream": stream, **long}
    _, before = running_and_generated(gateway)
    conn, response = None, None
    conn = gateway.connection()
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {
        "Content-Type": "application/json", **AUTH})  # fmt: skip
    if stream:
        response = conn.getresponse()
        assert response.status == 200 and read_events(response, 2)
    else:
        deadline = time.monotonic() + 30
        while running_and_generated(gateway)[0] < len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.02)
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    while running_and_generated(gateway)[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    live, after = running_and_generated(gateway)
    assert live == 0
    assert after - before < len(PROMPTS) * long["max_tokens"]  # they ended early: aborted
