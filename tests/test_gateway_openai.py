"""The OpenAI-compatible routes, driven by the official `openai` package against a real server.

Greedy output over HTTP must equal what the ZeroMQ SDK gets for the same request.
"""

from __future__ import annotations

import json
import re
import time

import openai
import pytest
from gateway_support import (
    ACTORS_AND_GATEWAY,
    API_KEY,
    AUTH,
    HEALTH_INTERVAL_S,
    call,
    open_stream,
    read_events,
    shared_gateway,
    wait_until,
)

from actorserve.messages.common import SamplingParams
from support import tokenizer

PROMPT = "def fibonacci(n):"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three primes."},
]


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(
        base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
    ) as client:
        yield client


def sdk_greedy(gateway, prompt, max_tokens: int, **params):
    return gateway.client.complete(
        prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    )


def chat_prompt_ids(model_dir, messages) -> list[int]:
    tok = tokenizer(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_completion_greedy_text_equals_the_sdk(gateway, client):
    expected = sdk_greedy(gateway, PROMPT, 24)
    result = client.completions.create(
        model=gateway.model_name, prompt=PROMPT, max_tokens=24, temperature=0
    )
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.choices[0].text == expected.text and expected.text
    assert result.choices[0].finish_reason == expected.finish_reason.value
    assert result.usage.prompt_tokens == expected.prompt_tokens
    assert result.usage.completion_tokens == expected.completion_tokens == 24
    assert result.usage.total_tokens == expected.prompt_tokens + 24


def test_streamed_completion_joins_to_the_same_text_and_ends_with_usage(gateway, client):
    expected = sdk_greedy(gateway, PROMPT, 24)
    chunks = list(
        client.completions.create(
            model=gateway.model_name,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "a streamed answer comes in more than one piece"
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.usage.prompt_tokens == expected.prompt_tokens


def test_chat_uses_the_checkpoint_template_and_equals_the_sdk(gateway, client, llama_dir):
    ids = chat_prompt_ids(llama_dir, CHAT)
    assert ids[:2] == [1, 3], "BOS then <|im_start|>: the template places BOS exactly once"
    expected = sdk_greedy(gateway, ids, 20)
    result = client.chat.completions.create(
        model=gateway.model_name, messages=CHAT, max_completion_tokens=20, temperature=0
    )
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    message = result.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == 20

    stream = client.chat.completions.create(
        model=gateway.model_name,
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(ids) + 20


@pytest.mark.parametrize(
    "path, body, kind",
    [
        ("/v1/completions", {"prompt": PROMPT}, "text_completion"),
        ("/v1/chat/completions", {"messages": CHAT}, "chat.completion.chunk"),
    ],
)
def test_sse_is_framed_exactly_as_openai_frames_it(gateway, path, body, kind):
    body = {**body, "max_tokens": 6, "stream": True}
    conn, response = open_stream(gateway, path, body, AUTH)
    try:
        assert response.status == 200
        assert response.getheader("content-type").startswith("text/event-stream")
        raw = response.read().decode()
    finally:
        conn.close()
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    for frame in frames[:-2]:
        assert re.fullmatch(r"data: \{.*\}", frame), frame
        chunk = json.loads(frame[len("data: ") :])
        assert chunk["object"] == kind and chunk["model"] == gateway.model_name


def test_vllm_extras_apply_stop_token_ids_and_seed(gateway, client):
    greedy = sdk_greedy(gateway, PROMPT, 12, ignore_eos=True)
    stop_at = greedy.token_ids[4]
    first_stop = greedy.token_ids.index(stop_at)
    result = client.completions.create(
        model=gateway.model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [stop_at], "ignore_eos": True},
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens == first_stop + 1

    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=gateway.model_name,
                prompt=PROMPT,
                max_tokens=12,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_models_names_the_served_model(gateway, client):
    models = client.models.list().data
    assert [m.id for m in models] == [gateway.model_name]
    assert models[0].object == "model"


def test_ready_pushes_a_real_token_through_every_actor_and_health_none(gateway):
    time.sleep(HEALTH_INTERVAL_S)  # past any answer an earlier test left to be repeated
    before = gateway.client.health().stats.generation_tokens
    reply = call(gateway, "GET", "/ready", headers=AUTH)  # open; the key adds the roster
    assert reply.status == 200
    body = reply.json()
    assert body["status"] == "ok" and body["probe_s"] > 0 and body["age_s"] < 0.5
    assert {a["name"] for a in body["actors"]} == ACTORS_AND_GATEWAY
    assert all(a["state"] == "ready" for a in body["actors"])
    assert gateway.client.health().stats.generation_tokens == before + 1

    live = call(gateway, "GET", "/health", headers=AUTH)
    assert live.status == 200 and live.json()["status"] == "ok"
    assert {a["name"] for a in live.json()["actors"]} == {a["name"] for a in body["actors"]}
    assert gateway.client.health().stats.generation_tokens == before + 1  # liveness: no token


def test_metrics_expose_engine_counters_and_latency_histograms(gateway, client):
    """Every request's end-to-end latency; a streamed one's first token and time per token too
    (a whole completion's tokens come back at once: no first-token time to see)."""
    client.completions.create(model=gateway.model_name, prompt=PROMPT, max_tokens=5, temperature=0)
    stream = client.completions.create(
        model=gateway.model_name, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    reply = call(gateway, "GET", "/metrics", headers=AUTH)
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    text = reply.body.decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.split("{")[0]] = samples.get(name.split("{")[0], 0.0) + float(value)
    stats = gateway.client.health().stats
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "kv_cache_blocks_total",
    ):
        assert f"actorserve_{name}" in samples, name
    assert samples["actorserve_kv_cache_blocks_total"] == stats.blocks_total
    assert samples["actorserve_prompt_tokens_total"] > 0
    assert samples["actorserve_generation_tokens_total"] >= 5
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert samples[f"actorserve_{name}_count"] >= 1, name
        assert f'actorserve_{name}_bucket{{le="+Inf"' in text


def test_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(gateway):
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    generated_before = gateway.client.health().stats.generation_tokens
    conn, response = open_stream(gateway, "/v1/completions", body, AUTH)
    assert len(read_events(response, 3)) == 3
    stats = gateway.client.health().stats
    assert stats.num_running == 1 and stats.blocks_free < stats.blocks_total
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    stats = gateway.wait_blocks_free(timeout_s=5)
    assert stats.blocks_free == stats.blocks_total and stats.num_running == 0
    assert stats.generation_tokens - generated_before < 400


def test_disconnect_while_waiting_for_a_whole_completion_aborts_it(gateway):
    conn = gateway.connection()
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": CHAT, "max_tokens": 400, "ignore_eos": True}).encode(),
        {"Content-Type": "application/json", **AUTH},
    )
    assert wait_until(lambda: gateway.client.health().stats.num_running == 1, 10)
    conn.sock.close()
    conn.close()
    stats = gateway.wait_blocks_free(timeout_s=5)
    assert stats.blocks_free == stats.blocks_total and stats.num_running == 0


def test_a_tokenizer_without_a_chat_template_gets_the_simple_built_in_one(llama_dir, tmp_path):
    from actorserve.gateway.chat_template import ChatTemplate

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    chat = ChatTemplate(tmp_path)
    assert chat.builtin
    ids = chat.prompt_ids([{"role": "user", "content": "hi"}])
    tok = tokenizer(llama_dir)
    assert ids == tok.encode("<|user|>\nhi\n<|assistant|>\n")  # BOS first, like any prompt
    assert ids[0] == tok.bos_token_id


def test_completion_stop_string_cuts_the_text_like_the_sdk(gateway, client):
    full = sdk_greedy(gateway, PROMPT, 30, ignore_eos=True)
    stop = full.text[len(full.text) // 2 :][:2]
    result = client.completions.create(
        model=gateway.model_name,
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].text == full.text[: full.text.index(stop)]
    assert result.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(gateway, client, route):
    common = dict(
        model=gateway.model_name,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    if route == "chat":
        stream = client.chat.completions.create(messages=CHAT, **common)
    else:
        stream = client.completions.create(prompt=PROMPT, **common)
    chunks = [c for c in stream if c.choices]
    counted = [c.usage.completion_tokens for c in chunks if route == "completions" or c.usage]
    assert all(c.usage is not None for c in chunks[route == "chat" :])  # chat's role chunk: none
    assert counted == sorted(counted) and counted[-1] == 12
