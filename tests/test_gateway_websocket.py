"""WebSocket /v1/stream: several requests at once on one socket, aborts, disconnects, bad input."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
import websockets
from gateway_support import API_KEY, AUTH, shared_gateway
from websockets.asyncio.client import connect

from actorserve.messages.common import SamplingParams


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


def ws_url(gateway) -> str:
    return gateway.url.replace("http://", "ws://") + "/v1/stream"


async def receive(ws, timeout_s: float = 30.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


async def test_three_requests_run_at_once_on_one_socket_and_one_is_aborted_midway(gateway):
    greedy = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
    requests = [
        {"type": "generate", "id": "a", "prompt": "import asyncio\n", "params": greedy},
        {
            "type": "generate",
            "id": "b",
            "prompt": "class Queue:",
            "params": {"temperature": 0, "max_tokens": 300, "ignore_eos": True},
        },
        {"type": "generate", "id": "c", "prompt_token_ids": [1, 500, 600, 700], "params": greedy},
    ]
    log: list[dict] = []
    async with connect(ws_url(gateway), additional_headers=AUTH) as ws:
        for request in requests:
            await ws.send(json.dumps(request))
        done: dict[str, dict] = {}
        aborted = False
        while len(done) < 3:
            message = await receive(ws)
            log.append(message)
            assert message["type"] in ("delta", "done"), message
            if message["type"] == "done":
                done[message["id"]] = message
            b_deltas = sum(1 for m in log if m["id"] == "b" and m["type"] == "delta")
            if not aborted and b_deltas >= 3:
                await ws.send(json.dumps({"type": "abort", "id": "b"}))
                aborted = True

    deltas = defaultdict(list)
    for m in log:
        if m["type"] == "delta":
            deltas[m["id"]].append(m)
    first_done = next(i for i, m in enumerate(log) if m["type"] == "done")
    for rid in "abc":  # all three were streaming before any of them finished
        assert log.index(deltas[rid][0]) < first_done, rid

    for rid, prompt in (("a", "import asyncio\n"), ("c", [1, 500, 600, 700])):
        expected = gateway.client.complete(prompt, SamplingParams(**greedy))
        assert "".join(d["text"] for d in deltas[rid]) == expected.text
        assert [t for d in deltas[rid] for t in d["token_ids"]] == expected.token_ids
        assert done[rid]["finish_reason"] == "length"
        usage = done[rid]["usage"]
        assert usage["completion_tokens"] == 20 and usage["prompt_tokens"] == expected.prompt_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + 20

    assert done["b"]["finish_reason"] == "abort"
    b_tokens = sum(len(d["token_ids"]) for d in deltas["b"])
    assert 3 <= b_tokens == done["b"]["usage"]["completion_tokens"] < 300
    stats = gateway.wait_blocks_free(timeout_s=5)
    assert stats.blocks_free == stats.blocks_total


async def test_closing_the_socket_aborts_all_of_its_requests(gateway):
    long = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    async with connect(ws_url(gateway), additional_headers=AUTH) as ws:
        for rid in ("x", "y"):
            await ws.send(
                json.dumps({"type": "generate", "id": rid, "prompt": f"{rid} = [", "params": long})
            )
        seen: set[str] = set()
        while seen != {"x", "y"}:
            seen.add((await receive(ws))["id"])
        assert gateway.client.health().stats.num_running == 2
    stats = await asyncio.to_thread(gateway.wait_blocks_free, 5)
    assert stats.blocks_free == stats.blocks_total and stats.num_running == 0


async def test_bad_messages_get_errors_naming_the_field_and_the_socket_goes_on(gateway):
    async with connect(ws_url(gateway), additional_headers=AUTH) as ws:
        await ws.send("{not json")
        error = await receive(ws)
        assert error == {
            "type": "error",
            "id": None,
            "status": 400,
            "param": None,
            "message": error["message"],
        }
        assert "not valid JSON" in error["message"]

        await ws.send(
            json.dumps(
                {"type": "generate", "id": "t", "prompt": "hi", "params": {"temperature": -1}}
            )
        )
        error = await receive(ws)
        assert (error["type"], error["id"], error["status"], error["param"]) == (
            "error",
            "t",
            400,
            "temperature",
        )

        await ws.send(
            json.dumps(
                {"type": "generate", "id": "m", "prompt": "hi", "params": {"max_tokens": "many"}}
            )
        )
        error = await receive(ws)
        assert (error["id"], error["status"], error["param"]) == ("m", 400, "params.max_tokens")

        await ws.send(
            json.dumps({"type": "generate", "id": "p", "prompt": "hi", "prompt_token_ids": [1, 2]})
        )
        assert (await receive(ws))["param"] == "prompt_token_ids"

        await ws.send(json.dumps({"type": "abort", "id": "nobody"}))
        error = await receive(ws)
        assert (error["id"], error["status"]) == ("nobody", 404)

        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "ok",
                    "params": {"max_tokens": 3},
                    "messages": [{"role": "user", "content": "hello"}],
                }
            )
        )
        messages = []
        while not messages or messages[-1]["type"] != "done":
            messages.append(await receive(ws))
        assert messages[-1]["id"] == "ok" and messages[-1]["usage"]["completion_tokens"] == 3


async def test_a_socket_needs_the_api_key_as_header_or_as_subprotocol(gateway):
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with connect(ws_url(gateway)):
            pass
    assert refused.value.response.status_code == 403
    async with connect(ws_url(gateway), subprotocols=["actorserve", f"bearer.{API_KEY}"]) as ws:
        assert ws.subprotocol == "actorserve"
        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "k",
                    "prompt": "x",
                    "params": {"max_tokens": 2, "ignore_eos": True},
                }
            )
        )
        while (message := await receive(ws))["type"] != "done":
            assert message["type"] == "delta"
        assert message["finish_reason"] == "length"
