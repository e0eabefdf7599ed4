"""The final text of a completion is `tokenizer.decode(output_ids)` however the output ends, even
in the middle of a UTF-8 character (issue 24, test 5): streamed and whole, HTTP and SDK."""

from __future__ import annotations

import json

import pytest
from gateway_support import AUTH, call, open_stream, read_events, shared_gateway

from actorserve.messages.common import SamplingParams
from support import tokenizer

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


def partial_byte_tokens(model_dir) -> list[int]:
    """Token ids that are leading bytes of multi-byte UTF-8 characters (alone: no character)."""
    tok = tokenizer(model_dir)
    ids = tok.encode("東京🚀", add_special_tokens=False)
    partial = [ids[i] for i in range(len(ids)) if "\ufffd" in tok.decode(ids[: i + 1])[-1:]]
    assert partial, "the BPE tokenizer has byte tokens for these characters"
    return partial


def forced_tail(token: int, max_tokens: int) -> dict:
    """A greedy request whose logit_bias makes every output token `token`."""
    return {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": {str(token): 100},
    }


def sdk_ids(gateway, tok, token: int, max_tokens: int) -> list[int]:
    """The output ids of forced_tail's request, through the SDK (which sees token ids)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias={token: 100})
    result = gateway.client.complete(PROMPT, params)
    assert result.text == tok.decode(result.token_ids, skip_special_tokens=True)
    return result.token_ids


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_whole_completion_ending_mid_character_is_decode_of_its_ids(
    llama_dir, gateway, max_tokens
):
    tok = tokenizer(llama_dir)
    for token in partial_byte_tokens(llama_dir)[:2]:
        ids = sdk_ids(gateway, tok, token, max_tokens)
        assert ids == [token] * max_tokens
        body = {"model": gateway.model_name, **forced_tail(token, max_tokens)}
        reply = call(gateway, "POST", "/v1/completions", body, AUTH)
        assert reply.status == 200, reply.body
        [choice] = reply.json()["choices"]
        assert choice["text"] == tok.decode(ids, skip_special_tokens=True)
        assert choice["text"].endswith("\ufffd")


def test_a_streamed_completion_ending_mid_character_sends_the_flushed_bytes(llama_dir, gateway):
    tok = tokenizer(llama_dir)
    token = partial_byte_tokens(llama_dir)[0]
    ids = sdk_ids(gateway, tok, token, 2)
    body = {"model": gateway.model_name, "stream": True, **forced_tail(token, 2)}
    conn, response = open_stream(gateway, "/v1/completions", body, AUTH)
    try:
        events = read_events(response)
    finally:
        conn.close()
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    text = "".join(c["text"] for c in choices)
    assert text == tok.decode(ids) and text.endswith("\ufffd")
    assert choices[-1]["finish_reason"] == "length"


def test_the_sdk_text_of_any_output_equals_decode_of_its_ids(llama_dir, gateway):
    """Sampled outputs of the random checkpoint end wherever they end; every one decodes."""
    tok = tokenizer(llama_dir)
    token = partial_byte_tokens(llama_dir)[-1]
    for seed in range(6):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=7, logit_bias={token: 4.0})
        result = gateway.client.complete(PROMPT, params)
        assert result.text == tok.decode(result.token_ids, skip_special_tokens=True)
