"""Every error the gateway answers: the status, and OpenAI's JSON error shape naming the field.

{"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
           "code": "..."}}
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from gateway_support import (
    ACTORS_AND_GATEWAY,
    AUTH,
    HEALTH_INTERVAL_S,
    GatewayServer,
    call,
    open_stream,
    read_events,
    shared_gateway,
    wait_until,
)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


def assert_error(reply, status: int, param: str | None = None, says: str = "") -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ERROR_TYPES[status]
    assert error["param"] == param, error
    assert says.lower() in error["message"].lower(), error["message"]
    return error


COMPLETION = {"prompt": "hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

BAD_BODIES = [  # (route, body, param, the message says)
    ("completions", {**COMPLETION, "max_tokens": "ten"}, "max_tokens", "expected `int"),
    ("completions", {**COMPLETION, "temperature": "hot"}, "temperature", "expected `float"),
    ("completions", {**COMPLETION, "prompt": 42}, "prompt", "expected `str | array`"),
    ("completions", {"max_tokens": 4}, "prompt", "missing required field"),
    ("completions", {**COMPLETION, "temprature": 0.5}, "temprature", "unrecognized"),
    ("completions", {**COMPLETION, "max_tokens": -1}, "max_tokens", ">= 0"),
    ("completions", {**COMPLETION, "temperature": -0.5}, "temperature", ">= 0"),
    ("completions", {**COMPLETION, "top_p": 1.5}, "top_p", "(0, 1]"),
    ("completions", {**COMPLETION, "top_k": -5}, "top_k", "top_k must be"),
    ("completions", {**COMPLETION, "min_p": 2}, "min_p", "[0, 1]"),
    ("completions", {**COMPLETION, "seed": -1}, "seed", "seed must be"),
    ("completions", {**COMPLETION, "min_tokens": 9}, "min_tokens", "max_tokens=4"),
    ("completions", {**COMPLETION, "stop_token_ids": [99999999]}, "stop_token_ids", "vocab"),
    ("completions", {**COMPLETION, "n": 65}, "n", "<= 64"),
    ("completions", {**COMPLETION, "n": 0}, "n", ">= 1"),
    ("completions", {**COMPLETION, "presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ("completions", {**COMPLETION, "frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ("completions", {**COMPLETION, "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("completions", {**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("completions", {**COMPLETION, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("completions", {**COMPLETION, "logit_bias": {"99999999": 1}}, "logit_bias", "vocab_size"),
    ("completions", {**COMPLETION, "stop": [""]}, "stop", "non-empty strings"),
    ("completions", {**COMPLETION, "logprobs": 21}, "logprobs", "[0, 20]"),
    ("completions", {**COMPLETION, "prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    (
        "completions",
        {**COMPLETION, "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
        "stream",
    ),
    ("chat/completions", {**CHAT, "echo": True}, "echo", "unrecognized"),
    ("completions", {**COMPLETION, "prompt": ["a"] * 5}, "prompt", "max_concurrent_requests=4"),
    ("completions", {**COMPLETION, "prompt": ["a", 5]}, "prompt", "prompt[1] must be a string"),
    ("completions", {**COMPLETION, "prompt": []}, "prompt", "must not be empty"),
    ("completions", {**COMPLETION, "prompt": ["a", [5] * 600]}, "prompt", "prompt[1]: "),
    ("completions", {**COMPLETION, "stream": True, "temperature": -1}, "temperature", ">= 0"),
    ("completions", {**COMPLETION, "prompt": [5] * 600}, "prompt", "max_model_len is 512"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": 1, "content": "x"}]},
        "messages[0].role",
        "expected `str`",
    ),
    ("chat/completions", {**CHAT, "messages": []}, "messages", "at least one"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    (
        "chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "[0, 20]",
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "word " * 600}]},
        "messages",
        "max_model_len is 512",
    ),
    ("chat/completions", {**CHAT, "stream": True, "top_p": 0}, "top_p", "(0, 1]"),
]


@pytest.mark.parametrize(
    "route, body, param, says",
    BAD_BODIES,
    ids=[f"{r}-{p}-{i}" for i, (r, _, p, _) in enumerate(BAD_BODIES)],
)
def test_a_bad_request_is_a_400_naming_the_field(gateway, route, body, param, says):
    reply = call(gateway, "POST", f"/v1/{route}", body, AUTH)
    assert_error(reply, 400, param, says)


def test_a_body_that_is_not_json_is_a_400(gateway):
    for raw in (b"{not json", b"", b"[1, 2]"):
        reply = call(gateway, "POST", "/v1/completions", headers=AUTH, raw=raw)
        error = assert_error(reply, 400)
        assert "JSON" in error["message"] or "object" in error["message"]


def test_an_unknown_model_is_a_404(gateway):
    reply = call(gateway, "POST", "/v1/completions", {**COMPLETION, "model": "gpt-9"}, AUTH)
    assert assert_error(reply, 404, "model", "gpt-9")["code"] == "model_not_found"


def test_a_body_over_the_size_limit_is_a_413(gateway):
    reply = call(gateway, "POST", "/v1/completions", {"prompt": "x" * 70_000}, AUTH)
    assert_error(reply, 413, None, "65536")


def test_every_route_but_health_and_the_page_needs_the_api_key(gateway):
    for method, path, body in (
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key-123"}):
            reply = call(gateway, method, path, body, headers)
            assert assert_error(reply, 401)["code"] == "invalid_api_key", (path, headers)
            assert reply.headers["www-authenticate"] == "Bearer"
    assert call(gateway, "GET", "/health").status == 200
    assert call(gateway, "GET", "/ready").status == 200
    assert call(gateway, "GET", "/").status == 200


def test_an_unknown_route_is_a_404_in_the_same_shape(gateway):
    assert_error(call(gateway, "GET", "/v1/nothing", headers=AUTH), 404)


def test_over_the_concurrency_limit_is_a_429_with_retry_after(gateway):
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    streams = [open_stream(gateway, "/v1/completions", body, AUTH) for _ in range(4)]
    try:
        for _, response in streams:
            assert response.status == 200 and read_events(response, 1)
        reply = call(gateway, "POST", "/v1/completions", COMPLETION, AUTH)
        error = assert_error(reply, 429, None, "max_concurrent_requests=4")
        assert error["code"] == "rate_limit_exceeded"
        assert reply.headers["retry-after"] == "1"
    finally:
        for conn, _ in streams:
            conn.sock.close()
            conn.close()
    gateway.wait_blocks_free(timeout_s=5)
    assert wait_until(
        lambda: call(gateway, "POST", "/v1/completions", COMPLETION, AUTH).status == 200, 5
    )


def test_ready_is_a_503_when_a_token_cannot_get_through_while_health_stays_200(gateway):
    worker = next(a for a in gateway.client.health().actors if a.name == "worker")
    time.sleep(HEALTH_INTERVAL_S)  # past any answer an earlier test left to be repeated
    os.kill(worker.pid, signal.SIGSTOP)  # alive, heartbeat not yet missed, but computes nothing
    try:
        reply = call(gateway, "GET", "/ready", headers=AUTH)
        live = call(gateway, "GET", "/health")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert reply.status == 503
    body = reply.json()
    assert body["status"] == "unavailable" and "within 3 s" in body["error"]
    assert {a["name"] for a in body["actors"]} == ACTORS_AND_GATEWAY
    assert live.status == 200, live.body  # liveness pushes no token through the Worker
    assert wait_until(lambda: call(gateway, "GET", "/ready").status == 200, 10)


def test_sigterm_drains_streams_in_flight_refuses_new_ones_with_503_then_exits_0(llama_dir):
    server = GatewayServer(llama_dir)
    try:
        body = {
            "prompt": "def f():",
            "max_tokens": 150,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn, response = open_stream(server, "/v1/completions", body)
        first = read_events(response, 2)
        server.proc.send_signal(signal.SIGTERM)

        def refused():
            reply = call(server, "POST", "/v1/completions", COMPLETION)
            return reply if reply.status == 503 else None

        reply = wait_until(refused, 10)
        assert reply, "new requests are refused while draining"
        assert_error(reply, 503)
        assert reply.headers["retry-after"] == "1"
        assert call(server, "GET", "/health").status == 503
        rest = read_events(response)
        conn.close()
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(e) for e in first + rest[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 150
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
        assert "Traceback" not in server.log()
    finally:
        server.stop()
