"""Prompt scoring on /v1/completions: `echo`, `logprobs` over the prompt, `max_tokens: 0`
(what lm-evaluation-harness's local-completions model sends), against transformers in fp32.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from gateway_support import API_KEY, AUTH, call, open_stream, read_events, shared_gateway

from support import hf_model, prompts_of_lengths, tokenizer

ATOL = 1e-4
PROMPT_TEXT = "def fibonacci(n):\n    return n"


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: transformers' log_softmax (fp32) at every position of `ids`."""
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def completion(gateway, **body) -> dict:
    reply = call(gateway, "POST", "/v1/completions", {"model": gateway.model_name, **body}, AUTH)
    assert reply.status == 200, reply.body
    return reply.json()


def streamed(gateway, **body) -> list[dict]:
    body = {"model": gateway.model_name, "stream": True, **body}
    conn, response = open_stream(gateway, "/v1/completions", body, AUTH)
    try:
        assert response.status == 200
        events = read_events(response)
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_prompt_scored(model_dir, prompt: list[int], logprobs: dict, k: int) -> None:
    """The legacy logprobs of an echoed prompt equal transformers' (null for its first token)."""
    reference = hf_logprobs(model_dir, prompt)
    names = [tokenizer(model_dir).decode([t]) for t in prompt]
    assert logprobs["tokens"][: len(prompt)] == names
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [reference[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected, abs=ATOL)
    for j in range(1, len(prompt)):
        top = logprobs["top_logprobs"][j]
        assert k <= len(top) <= k + 1  # the top k, and the prompt's token when not among them
        best = reference[j - 1].topk(k).values.tolist()
        assert sorted(top.values(), reverse=True)[:k] == pytest.approx(best, abs=ATOL)
    offsets = logprobs["text_offset"][: len(prompt)]
    assert offsets == [sum(len(n) for n in names[:j]) for j in range(len(prompt))]


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers_does(llama_dir, gateway):
    prompt = prompts_of_lengths(llama_dir, [90])[0]  # prefilled in more than one chunk
    out = completion(gateway, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    [choice] = out["choices"]
    assert choice["text"] == tokenizer(llama_dir).decode(prompt)
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt)  # nothing generated
    assert_prompt_scored(llama_dir, prompt, choice["logprobs"], 3)
    assert out["usage"] == {"prompt_tokens": 90, "completion_tokens": 0, "total_tokens": 90}


def test_a_streamed_echo_sends_the_same_prompt_scores_then_finishes(llama_dir, gateway):
    prompt = prompts_of_lengths(llama_dir, [20])[0]
    whole = completion(gateway, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    chunks = streamed(
        gateway,
        prompt=prompt,
        echo=True,
        logprobs=2,
        max_tokens=0,
        stream_options={"include_usage": True},
    )
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert choices[0]["text"] == whole["choices"][0]["text"]
    assert choices[0]["logprobs"] == whole["choices"][0]["logprobs"]
    assert choices[-1]["finish_reason"] == "length" and choices[-1]["text"] == ""
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_echo_with_generation_puts_the_prompt_before_the_generated_text(llama_dir, gateway):
    tok = tokenizer(llama_dir)
    plain = completion(gateway, prompt=PROMPT_TEXT, max_tokens=5, temperature=0, logprobs=1)
    echoed = completion(
        gateway, prompt=PROMPT_TEXT, max_tokens=5, temperature=0, logprobs=1, echo=True
    )
    [p], [e] = plain["choices"], echoed["choices"]
    assert e["text"] == PROMPT_TEXT + p["text"]
    prompt_ids = tok.encode(PROMPT_TEXT)  # as the Engine tokenizes a text prompt
    assert_prompt_scored(llama_dir, prompt_ids, e["logprobs"], 1)
    generated = {key: value[len(prompt_ids) :] for key, value in e["logprobs"].items()}
    assert generated["tokens"] == p["logprobs"]["tokens"]
    assert generated["token_logprobs"] == pytest.approx(p["logprobs"]["token_logprobs"], abs=ATOL)
    start = sum(len(t) for t in e["logprobs"]["tokens"][: len(prompt_ids)])
    assert generated["text_offset"] == [start + o for o in p["logprobs"]["text_offset"]]
    assert e["finish_reason"] == p["finish_reason"]

    chunks = streamed(gateway, prompt=PROMPT_TEXT, max_tokens=5, temperature=0, echo=True)
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == e["text"]


def test_every_choice_of_n_echoes_the_prompt(llama_dir, gateway):
    prompt = prompts_of_lengths(llama_dir, [12])[0]
    out = completion(gateway, prompt=prompt, echo=True, logprobs=1, max_tokens=0, n=3)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({json.dumps(c) for c in (ch | {"index": 0} for ch in out["choices"])}) == 1
    chunks = streamed(gateway, prompt=prompt, echo=True, logprobs=1, max_tokens=2, n=2)
    firsts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1]
    for c in firsts.values():  # each choice's first chunk is the scored prompt
        assert c["logprobs"]["tokens"] == out["choices"][0]["logprobs"]["tokens"]


def test_max_tokens_0_without_echo_returns_no_text(gateway):
    out = completion(gateway, prompt=PROMPT_TEXT, max_tokens=0, logprobs=2)
    [choice] = out["choices"]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == []
    assert out["usage"]["completion_tokens"] == 0


def test_the_openai_sdk_reads_an_echoed_prompt_score(llama_dir, gateway):
    prompt = prompts_of_lengths(llama_dir, [16])[0]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        out = client.completions.create(
            model=gateway.model_name, prompt=prompt, echo=True, logprobs=1, max_tokens=0
        )
    logprobs = out.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == 16


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": 0, "min_tokens": 2}, "min_tokens"),
        ("completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": 1}, "echo"),
    ],
)
def test_a_scoring_request_out_of_range_is_a_400_naming_the_field(gateway, route, body, field):
    reply = call(gateway, "POST", f"/v1/{route}", {"model": gateway.model_name, **body}, AUTH)
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["param"] == field
