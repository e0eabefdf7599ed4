"""A slow reader costs its own requests only: a client that takes none of its output for
send_timeout_s has its requests aborted and their KV blocks freed, through every door (the
SDK's socket, HTTP, SSE, WebSocket), while other clients' streams go on as if it were not there.

Each slow reader asks for output it cannot take (logprobs, several samples, a small receive
buffer), far more than it could be given before the timeout: its request is over within
send_timeout_s and some slack, well before its tokens are done. Meanwhile a normal client
streams the same greedy completion again and again; each equals the one it got undisturbed.
(Every KV block back after each test: conftest.py.)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import zmq
from gateway_support import (
    GatewayServer,
    gauge,
    open_raw_websocket,
    open_stream,
    raw_socket,
    read_events,
    wait_until,
    websocket_frame,
)
from websockets.asyncio.client import connect

from actorserve.gateway.blocking_client import Client
from actorserve.messages.client import GenerateRequest, Ping
from actorserve.messages.codec import encode
from actorserve.messages.common import SamplingParams
from support import prompts_of_lengths

SEND_TIMEOUT_S = 2.0
# what the abort may take beyond send_timeout_s: filling the buffers on the way, the Engine's
# retry period (at most 0.2 s), the abort's round trip, on a machine shared with other work
SLACK_S = 10.0
SAMPLES = 4  # of each slow request: it counts as 4 requests in the Engine
MAX_TOKENS = 1500  # each sample's, unless aborted: a stream far longer than the timeout
NORMAL = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
DROPPED = "it took none of our output for 2 s (send_timeout_s)"  # the gateway's log


@pytest.fixture(scope="module")
def server(llama_dir):
    server = GatewayServer(
        llama_dir,
        "--send-timeout-s",
        str(SEND_TIMEOUT_S),
        "--client-queue-messages",  # the Engine holds a client's replies past 8 queued
        "8",
        "--max-model-len",
        "2048",
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def prompts(llama_dir):
    slow, normal = prompts_of_lengths(llama_dir, [400, 20])
    return slow, normal


def live_requests(server) -> int:
    stats = server.client.health().stats
    return stats.num_running + stats.num_waiting


class NormalClient:
    """Streams one greedy completion again and again, on a thread, until stopped."""

    def __init__(self, run):
        self.run = run
        self.outputs: list = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.outputs.append(self.run())
        except BaseException as exc:  # the test asserts there are none
            self.errors.append(exc)

    def __enter__(self) -> NormalClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)


def assert_slow_reader_aborted_while_others_go_on(server, start_slow, normal_run):
    """Start the slow reader (`start_slow()` returns what to close); it must be over in the
    Engine within SEND_TIMEOUT_S + SLACK_S, before its tokens are done, while `normal_run()`
    gives what it gave undisturbed."""
    undisturbed = normal_run()
    assert live_requests(server) == 0
    tokens_before = server.client.health().stats.generation_tokens
    started = time.monotonic()
    slow = start_slow()
    try:
        with NormalClient(normal_run) as normal:
            seen = False
            while time.monotonic() - started < SEND_TIMEOUT_S + SLACK_S:
                live = live_requests(server)
                seen = seen or live >= SAMPLES
                if seen and live < SAMPLES:  # the normal client has one at most
                    break
                time.sleep(0.1)
            aborted_after = time.monotonic() - started
            time.sleep(0.5)  # the normal client goes on after the abort too
        assert seen, "the slow reader's request never ran"
        assert aborted_after < SEND_TIMEOUT_S + SLACK_S, "the slow reader's request still runs"
    finally:
        slow.close()
    assert not normal.errors, normal.errors
    assert normal.outputs and all(out == undisturbed for out in normal.outputs)
    normal_tokens = NORMAL["max_tokens"] * len(normal.outputs)
    slow_tokens = server.client.health().stats.generation_tokens - tokens_before - normal_tokens
    assert slow_tokens < SAMPLES * MAX_TOKENS, "the slow reader's tokens all came"


# -- the SDK's door: the Engine's client socket -----------------------------------------------


class SilentDealer:
    """A DEALER that never receives, with a small receive queue and buffer; it pings every
    0.5 s, as the SDK does while it streams, so its lease holds: only not reading is wrong."""

    def __init__(self, address: str, request: GenerateRequest):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 1)
        self.socket.setsockopt(zmq.RCVBUF, 4096)
        self.socket.connect(address)
        self.socket.send(encode(request))
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping, args=([request.request_id],))
        self._pinger.start()

    def _ping(self, ids: list[str]) -> None:
        while not self._stop.wait(0.5):
            self.socket.send(encode(Ping(ids)))

    def close(self) -> None:
        self._stop.set()
        self._pinger.join()
        self.socket.close()
        self.ctx.term()


def test_an_sdk_client_that_does_not_read_loses_its_requests_and_nobody_else_does(server, prompts):
    slow_prompt, normal_prompt = prompts
    big = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        n=SAMPLES,
        logprobs=20,
        prompt_logprobs=20,
    )
    request = GenerateRequest("slow", prompt_token_ids=slow_prompt, params=big)
    params = SamplingParams(**NORMAL)

    def normal_run():
        with Client(server.address, timeout_s=60) as client:
            return [t for d in client.generate(normal_prompt, params) for t in d.token_ids]

    assert_slow_reader_aborted_while_others_go_on(
        server, lambda: SilentDealer(server.address, request), normal_run
    )
    assert "took none of its replies for 2 s (send_timeout_s)" in server.log()


# -- the gateway's doors ----------------------------------------------------------------------


def sse_completion(server, prompt: list[int]) -> str:
    """A normal client: one streamed greedy completion over SSE, its text."""
    body = {"prompt": prompt, "stream": True, **NORMAL}
    conn, response = open_stream(server, "/v1/completions", body)
    try:
        assert response.status == 200
        events = read_events(response)
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])


def post_unread(server, body: dict):
    """POST /v1/completions on a socket with a small receive buffer, never read."""
    data = json.dumps(body).encode()
    sock = raw_socket(server, rcvbuf=4096)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return sock


def slow_body(prompt: list[int], **fields) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "n": SAMPLES,
        "logprobs": 20,
        **fields,
    }


def test_an_sse_client_that_does_not_read_loses_its_stream_and_nobody_else_does(server, prompts):
    slow_prompt, normal_prompt = prompts
    body = slow_body(slow_prompt, stream=True)
    assert_slow_reader_aborted_while_others_go_on(
        server, lambda: post_unread(server, body), lambda: sse_completion(server, normal_prompt)
    )
    assert DROPPED in server.log()


def test_an_http_client_that_does_not_read_its_response_is_dropped_and_nobody_else_is(
    server, prompts
):
    """A whole (not streamed) completion is sent only once it is done, so here the request
    is over before anything stalls; the answer it does not take (prompt logprobs of 8
    samples, megabytes) must still not hold its connection, nor harm anyone else."""
    slow_prompt, normal_prompt = prompts
    body = {**slow_body(slow_prompt, prompt_logprobs=20), "max_tokens": 1, "n": 8}
    undisturbed = sse_completion(server, normal_prompt)
    connections = gauge(server, "gateway_connections")
    drops = server.log().count(DROPPED)
    sock = post_unread(server, body)
    opened = time.monotonic()
    try:
        with NormalClient(lambda: sse_completion(server, normal_prompt)) as normal:
            assert wait_until(
                lambda: server.log().count(DROPPED) > drops, SEND_TIMEOUT_S + SLACK_S
            ), "the connection that does not read is still open"
            dropped_after = time.monotonic() - opened
    finally:
        sock.close()
    assert dropped_after < SEND_TIMEOUT_S + SLACK_S
    assert wait_until(lambda: gauge(server, "gateway_connections") <= connections, 10)
    assert not normal.errors, normal.errors
    assert normal.outputs and all(out == undisturbed for out in normal.outputs)


def test_a_websocket_client_that_does_not_read_loses_its_requests_and_nobody_else_does(
    server, prompts
):
    slow_prompt, normal_prompt = prompts
    params = {k: v for k, v in slow_body(slow_prompt).items() if k != "prompt"}
    frame = {"type": "generate", "id": "slow", "prompt_token_ids": slow_prompt, "params": params}

    def start_slow():
        sock = open_raw_websocket(server, rcvbuf=4096)
        sock.sendall(websocket_frame(json.dumps(frame).encode()))
        return sock

    assert_slow_reader_aborted_while_others_go_on(
        server, start_slow, lambda: websocket_completion(server, normal_prompt)
    )
    assert DROPPED in server.log()


def websocket_completion(server, prompt: list[int]) -> str:
    """A normal client: one greedy completion over the WebSocket, its text."""

    async def run() -> str:
        url = f"ws://{server.host}:{server.port}/v1/stream"
        async with connect(url) as ws:
            request = {"type": "generate", "id": "n", "prompt_token_ids": prompt, "params": NORMAL}
            await ws.send(json.dumps(request))
            text = []
            while (frame := json.loads(await ws.recv()))["type"] == "delta":
                text.append(frame["text"])
            assert frame["type"] == "done", frame
            return "".join(text)

    return asyncio.run(run())
