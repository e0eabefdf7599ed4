"""A gateway you can expose: its limits on connections, heads, bodies and sockets; clients that
stop reading; browsers' Origin and Host; /health (liveness) and /ready (readiness, rate-limited).

Most run on the session's shared gateway (API key, 64 KiB bodies, 3 requests per socket, a
health interval of 1 s). Those that need small connection limits and short timeouts share one
gateway of this module's own (`guarded`, no API key).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import websockets
from gateway_support import (
    AUTH,
    HEALTH_INTERVAL_S,
    GatewayServer,
    call,
    ended,
    gauge,
    open_raw_websocket,
    raw_socket,
    read_to_end,
    send_quietly,
    shared_gateway,
    wait_until,
    websocket_frame,
)
from websockets.asyncio.client import connect

COMPLETION = {"prompt": "hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
APP_ORIGIN = "https://app.example"
GUARDED_FLAGS = (
    "--max-connections",
    "4",
    "--read-timeout-s",
    "1",
    "--keep-alive-s",
    "1",
    "--send-timeout-s",
    "2",
    "--max-header-bytes",
    "4096",
    "--allowed-origins",
    APP_ORIGIN,
    "--allowed-hosts",
    "127.0.0.1,localhost",
)


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


@pytest.fixture(scope="module")
def guarded(llama_dir):
    server = GatewayServer(llama_dir, *GUARDED_FLAGS)
    yield server
    assert server.stop() == 0


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/stream"


async def receive(ws, timeout_s: float = 30.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


# -- bodies, heads, content types -------------------------------------------------------------


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_post_not_said_to_be_json_is_a_415_naming_the_header(gateway, route):
    body = COMPLETION if route == "completions" else CHAT
    for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
        reply = call(gateway, "POST", f"/v1/{route}", body, {**AUTH, "Content-Type": content_type})
        assert reply.status == 415, (content_type, reply.body)
        error = reply.json()["error"]
        assert "Content-Type must be application/json" in error["message"]
        assert error["code"] == "unsupported_media_type"
    utf8 = {**AUTH, "Content-Type": "Application/JSON; charset=utf-8"}
    assert call(gateway, "POST", f"/v1/{route}", body, utf8).status == 200


def test_a_chunked_body_is_held_to_the_same_limit_as_a_declared_one(gateway):
    def chunked(total: int) -> int:
        payload = json.dumps({**COMPLETION, "user": "u" * total}).encode()  # `user`: unused
        conn = gateway.connection()
        try:  # an iterable body and no Content-Length: http.client sends it chunked
            headers = {**AUTH, "Content-Type": "application/json"}
            chunks = (payload[i : i + 4096] for i in range(0, len(payload), 4096))
            conn.request("POST", "/v1/completions", chunks, headers, encode_chunked=True)
            response = conn.getresponse()
            body = json.loads(response.read())
            if response.status == 413:
                assert "65536" in body["error"]["message"]
            return response.status
        finally:
            conn.close()

    assert chunked(20_000) == 200
    assert chunked(70_000) == 413


def test_json_nested_past_the_decoders_depth_is_a_400_not_a_500(gateway):
    deep = "[" * 30_000 + "]" * 30_000
    for route, raw in (
        ("completions", f'{{"prompt": {deep}}}'),
        ("chat/completions", f'{{"messages": [], "tools": [{{"a": {deep}}}]}}'),
        ("chat/completions", f'{{"messages": [], "guided_json": {{"a": {deep}}}}}'),
        ("completions", "[" * 60_000),
    ):
        reply = call(gateway, "POST", f"/v1/{route}", headers=AUTH, raw=raw.encode())
        assert reply.status == 400, reply.body[:300]
        message = reply.json()["error"]["message"]
        assert "too deeply" in message or "Expected `object`" in message, message


def test_a_head_over_max_header_bytes_is_a_431_naming_the_limit(guarded):
    reply = call(guarded, "GET", "/v1/models", headers={"X-Padding": "p" * 5000})  # one read
    assert reply.status == 431
    assert "max_header_bytes=4096" in reply.json()["error"]["message"]
    sock = raw_socket(guarded)  # and in pieces
    for _ in range(10):
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n" if _ == 0 else b"X-A: " + b"a" * 500 + b"\r\n")
    assert read_to_end(sock).startswith(b"HTTP/1.1 431")
    sock.close()
    assert call(guarded, "GET", "/v1/models", headers={"X-Padding": "p" * 3000}).status == 200


def test_a_client_slow_to_send_its_head_or_body_is_cut_off_after_read_timeout(guarded):
    silent = raw_socket(guarded)  # connects, sends nothing: closed with no answer
    assert ended(silent, 10)
    silent.close()

    trickle = raw_socket(guarded)  # half a head, a byte at a time: 408, then closed
    trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    answer = b""
    for _ in range(40):
        try:
            trickle.send(b"X")
            time.sleep(0.1)
        except OSError:
            break
        trickle.settimeout(0.01)
        try:
            answer += trickle.recv(4096)
        except (TimeoutError, BlockingIOError):
            pass
    trickle.settimeout(10)
    try:
        answer += trickle.recv(4096)
    except OSError:
        pass
    trickle.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"read_timeout_s=1" in answer

    body = raw_socket(guarded)  # a head, then a body that stops coming: 408 from the route
    body.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    answer = read_to_end(body)
    body.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"read_timeout_s=1" in answer, answer[:300]


# -- connections and sockets ------------------------------------------------------------------


async def test_past_max_connections_http_and_websocket_handshakes_are_refused(guarded):
    sockets = [await connect(ws_url(guarded)) for _ in range(4)]  # the limit, all open
    try:
        reply = await asyncio.to_thread(call, guarded, "GET", "/v1/models")
        assert reply.status == 503  # uvicorn's own answer
        with pytest.raises(websockets.InvalidStatus) as refused:
            await connect(ws_url(guarded))
        assert refused.value.response.status_code == 503
        error = json.loads(refused.value.response.body)["error"]
        assert "max_connections=4" in error["message"]
    finally:
        for ws in sockets:
            await ws.close()
    assert wait_until(lambda: gauge(guarded, "gateway_connections") <= 1, 10)
    assert (await asyncio.to_thread(call, guarded, "GET", "/v1/models")).status == 200


async def test_a_socket_past_its_live_request_cap_gets_an_error_frame_and_goes_on(gateway):
    long = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    async with connect(ws_url(gateway), additional_headers=AUTH) as ws:
        for rid in ("a", "b", "c"):
            await ws.send(
                json.dumps({"type": "generate", "id": rid, "prompt": "x", "params": long})
            )
        await ws.send(json.dumps({"type": "generate", "id": "d", "prompt": "x", "params": long}))
        while (frame := await receive(ws))["type"] != "error":
            assert frame["id"] in "abc"
        assert (frame["id"], frame["status"]) == ("d", 429)
        assert "max_requests_per_socket=3" in frame["message"]
        await ws.send(json.dumps({"type": "abort", "id": "a"}))
        while not ((frame := await receive(ws))["type"] == "done" and frame["id"] == "a"):
            pass
        short = {"max_tokens": 2, "ignore_eos": True}
        await ws.send(json.dumps({"type": "generate", "id": "d", "prompt": "x", "params": short}))
        while not ((frame := await receive(ws))["type"] == "done" and frame["id"] == "d"):
            assert frame["type"] == "delta" or frame["id"] != "d"  # b and c may end meanwhile
        assert frame["usage"]["completion_tokens"] == 2


async def test_a_websocket_message_over_max_body_bytes_closes_the_socket_with_1009(gateway):
    async with connect(ws_url(gateway), additional_headers=AUTH, max_size=None) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": "x" * 70_000}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await receive(ws)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_a_websocket_client_that_stops_reading_is_dropped_and_its_request_aborted(guarded):
    connections = gauge(guarded, "gateway_connections")
    sock = open_raw_websocket(guarded, rcvbuf=4096)
    params = {"max_tokens": 1900, "ignore_eos": True}
    frame = {"type": "generate", "id": "long", "prompt": "x", "params": params}
    sock.sendall(websocket_frame(json.dumps(frame).encode()))
    assert wait_until(lambda: guarded.client.health().stats.num_running == 1, 10)
    # each junk message is answered by an error frame naming its id, which this client never
    # reads: the kernel's buffers fill, then every send of the socket waits
    junk = websocket_frame(json.dumps({"type": "junk", "id": "i" * 200}).encode())
    sender = threading.Thread(target=send_quietly, args=(sock, junk * 15_000))
    sender.start()
    # the slot of a request that cannot send is given back (else: forever, on the first send
    # that waits), and the request is over in the Engine
    assert wait_until(lambda: gauge(guarded, "gateway_requests_in_flight") == 0, 30)
    assert wait_until(lambda: guarded.client.health().stats.num_running == 0, 10)
    assert ended(sock, 10)
    sender.join(10)
    sock.close()
    assert wait_until(lambda: gauge(guarded, "gateway_connections") <= connections, 10)
    assert "send_timeout_s" in guarded.log()


def test_an_http_client_that_stops_reading_its_response_is_dropped(guarded):
    connections = gauge(guarded, "gateway_connections")
    # ~10 MB of answer for a small request: 8 choices, each repeating 1000 prompt logprobs
    body = json.dumps(
        {"prompt": list(range(10, 1010)), "max_tokens": 1, "n": 8, "prompt_logprobs": 20}
    ).encode()
    sock = raw_socket(guarded, rcvbuf=4096)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert wait_until(lambda: gauge(guarded, "gateway_connections") > connections, 10)
    assert wait_until(lambda: gauge(guarded, "gateway_connections") <= connections, 30)
    assert ended(sock, 10)
    sock.close()
    assert guarded.log().count("send_timeout_s") >= 1


# -- browsers: Origin, CORS, Host -------------------------------------------------------------


async def test_a_foreign_origin_is_refused_on_http_and_on_the_websocket_handshake(gateway):
    evil = {**AUTH, "Origin": "http://evil.example"}
    reply = await asyncio.to_thread(call, gateway, "POST", "/v1/completions", COMPLETION, evil)
    assert reply.status == 403
    assert "Origin 'http://evil.example' is not allowed" in reply.json()["error"]["message"]
    with pytest.raises(websockets.InvalidStatus) as refused:
        await connect(ws_url(gateway), additional_headers=AUTH, origin="http://evil.example")
    assert refused.value.response.status_code == 403
    assert b"allowed_origins" in refused.value.response.body

    own = {**AUTH, "Origin": gateway.url}  # the playground's own page: allowed
    reply = await asyncio.to_thread(call, gateway, "POST", "/v1/completions", COMPLETION, own)
    assert reply.status == 200
    async with connect(ws_url(gateway), additional_headers=AUTH, origin=gateway.url) as ws:
        await ws.send(json.dumps({"type": "abort", "id": "none"}))
        assert (await receive(ws))["status"] == 404


async def test_allowed_origins_get_cors_answers_and_hosts_outside_allowed_hosts_a_400(guarded):
    preflight = call(
        guarded,
        "OPTIONS",
        "/v1/completions",
        headers={
            "Origin": APP_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status == 200
    assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    reply = call(guarded, "POST", "/v1/completions", COMPLETION, {"Origin": APP_ORIGIN})
    assert reply.status == 200 and reply.headers["access-control-allow-origin"] == APP_ORIGIN
    other = call(guarded, "POST", "/v1/completions", COMPLETION, {"Origin": "https://x.example"})
    assert other.status == 403
    async with connect(ws_url(guarded), origin=APP_ORIGIN) as ws:
        await ws.send(json.dumps({"type": "abort", "id": "none"}))
        assert (await receive(ws))["status"] == 404

    reply = call(guarded, "GET", "/v1/models", headers={"Host": "rebound.example:80"})
    assert reply.status == 400
    assert "allowed_hosts" in reply.json()["error"]["message"]
    with pytest.raises(websockets.InvalidStatus) as refused:
        await connect(ws_url(guarded), additional_headers={"Host": "rebound.example"})
    assert refused.value.response.status_code == 400
    assert call(guarded, "GET", "/v1/models", headers={"Host": "localhost:1"}).status == 200


# -- /health and /ready -----------------------------------------------------------------------


def test_health_and_ready_show_pids_and_counters_only_to_the_key_holder(gateway):
    for path in ("/health", "/ready"):
        anyone = call(gateway, "GET", path)
        assert anyone.status == 200 and anyone.json()["status"] == "ok"
        assert not {"actors", "engine", "detail"} & set(anyone.json()), anyone.body
        assert b"pid" not in anyone.body
        holder = call(gateway, "GET", path, headers=AUTH).json()
        assert all(a["pid"] > 0 for a in holder["actors"]) and "blocks_total" in holder["engine"]


def test_a_flood_of_ready_runs_at_most_one_probe_per_interval(gateway):
    time.sleep(HEALTH_INTERVAL_S)
    before = gateway.client.health().stats.generation_tokens
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda _: call(gateway, "GET", "/ready"), range(64)))
        health = list(pool.map(lambda _: call(gateway, "GET", "/health"), range(64)))
    elapsed = time.monotonic() - started
    assert [r.status for r in replies + health] == [200] * 128
    probes = gateway.client.health().stats.generation_tokens - before  # one token each
    assert 1 <= probes <= 1 + int(elapsed / HEALTH_INTERVAL_S), (probes, elapsed)
    assert max(r.json()["age_s"] for r in replies) > 0, "later callers got the shared answer"


# -- the event loop ---------------------------------------------------------------------------


def test_a_chat_longer_than_max_model_len_can_hold_is_refused_without_tokenizing(guarded):
    """3.5 MB of chat would take seconds of CPU to template and tokenize; it is refused from
    its length in characters alone (messages.common.max_prompt_chars), while the gateway serves
    on. (Shorter chats are templated on a thread: Gateway.chat_prompt.)"""
    huge = {"messages": [{"role": "user", "content": "def f(x): return x  # " * 160_000}]}
    started = time.monotonic()
    reply = call(guarded, "POST", "/v1/chat/completions", huge)
    assert reply.status == 400 and reply.json()["error"]["param"] == "messages"
    assert "max_model_len" in reply.json()["error"]["message"]
    assert time.monotonic() - started < 2.0  # no tokenizing: a few MB of JSON only
    assert call(guarded, "GET", "/v1/models").status == 200
