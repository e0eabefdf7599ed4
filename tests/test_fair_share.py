"""A fair share for every client of the gateway (issue 35): one client holding every seat with
streams it never reads cannot keep another's short completion waiting, and what one client may
hold is bounded per API key (where keys are used) or per peer address, with a 429 naming the
limit. Real servers, raw sockets; no KV block is left held afterwards (conftest.py)."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from gateway_support import GatewayServer, open_stream, wait_until

HOGS = 64  # max_num_seqs on CPU: the hog's streams take every seat
LONG = 2000  # tokens of each hog stream (the prompt and these fit tiny-llama's 2048)


def post(server, body: dict, source: str = "127.0.0.1", key: str | None = None):
    """POST /v1/completions from the local address `source`; (status, headers, json)."""
    conn = http.client.HTTPConnection(server.host, server.port, 60, source_address=(source, 0))
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, json.loads(response.read())
    finally:
        conn.close()


def never_read(server, body: dict) -> socket.socket:
    """A streamed request on a socket whose client reads nothing (a small receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def assert_429(status: int, headers: dict, body: dict, limit: str) -> None:
    assert status == 429, body
    error = body["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert limit in error["message"], error["message"]
    assert headers.get("retry-after") == "1"


@pytest.fixture(scope="module")
def server(llama_dir):
    server = GatewayServer(
        llama_dir, "--max-client-requests", str(HOGS), "--max-client-output-tokens", "128000"
    )
    yield server
    assert server.stop() == 0


def test_streams_never_read_holding_every_seat_keep_another_client_waiting_no_step_or_two(
    server,
):
    short = {"model": server.model_name, "prompt": "def main(", "max_tokens": 8,
             "temperature": 0}  # fmt: skip
    status, _, alone = post(server, short, source="127.0.0.2")
    assert status == 200, alone
    hog = {"model": server.model_name, "prompt": "import os", "max_tokens": LONG,
           "ignore_eos": True, "stream": True}  # fmt: skip
    sockets = [never_read(server, hog) for _ in range(HOGS)]
    try:
        assert wait_until(lambda: server.client.health().stats.num_running == HOGS, 60)
        began = time.monotonic()
        status, _, busy = post(server, short, source="127.0.0.2")
        took = time.monotonic() - began
        assert status == 200, busy
        assert busy["choices"][0]["text"] == alone["choices"][0]["text"]
        assert took < 2.0, f"the short completion took {took:.1f} s behind {HOGS} streams"
        stats = server.client.health().stats
        assert stats.num_preemptions >= 1  # a hog stream gave its seat up, and waits for one
        # per address: the hog's 65th is refused; a third address is held to its tokens
        assert_429(*post(server, short), f"max_client_requests={HOGS}")
        many = {**short, "n": 64, "max_tokens": 2001}  # 64 x 2001 = 128064 output tokens
        assert_429(*post(server, many, source="127.0.0.3"), "max_client_output_tokens=128000")
    finally:
        for sock in sockets:
            sock.close()
    assert wait_until(lambda: server.client.health().stats.num_running == 0, 60)


@pytest.fixture(scope="module")
def keyed(llama_dir):
    server = GatewayServer(
        llama_dir,
        "--api-key", "key-a,key-b",
        "--max-client-requests", "2",
        "--max-client-output-tokens", "4000",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def held_stream(server, key: str, max_tokens: int):
    body = {"model": server.model_name, "prompt": "x", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn, response = open_stream(
        server, "/v1/completions", body, {"Authorization": f"Bearer {key}"}
    )
    assert response.status == 200  # its first token came: it is live in the engine
    return conn


def test_each_api_key_is_a_client_held_to_its_live_requests(keyed):
    short = {"model": keyed.model_name, "prompt": "y", "max_tokens": 4}
    held = [held_stream(keyed, "key-a", LONG) for _ in range(2)]
    try:
        assert_429(*post(keyed, short, key="key-a"), "max_client_requests=2")
        status, _, body = post(keyed, short, key="key-b")  # another key: its own share
        assert status == 200, body
        batch = {**short, "prompt": ["a", "b", "c"]}  # refused whole, before any prompt starts
        assert_429(*post(keyed, batch, key="key-b"), "max_client_requests=2")
    finally:
        for conn in held:
            conn.close()  # a disconnect aborts the request: its share comes back
    assert wait_until(lambda: post(keyed, short, key="key-a")[0] == 200, 30)


def test_each_api_key_is_a_client_held_to_its_reserved_output_tokens(keyed):
    held = [held_stream(keyed, "key-a", LONG)]
    try:
        over = {"model": keyed.model_name, "prompt": "y", "max_tokens": LONG + 1}
        assert_429(*post(keyed, over, key="key-a"), "max_client_output_tokens=4000")
        held.append(held_stream(keyed, "key-a", LONG))  # 2 x 2000: at the limit, not over
    finally:
        for conn in held:
            conn.close()
    assert wait_until(lambda: keyed.client.health().stats.num_running == 0, 30)
