"""Hostile input is normal input: whatever bytes reach the client socket, the Engine answers
what it can with an error, keeps serving everyone else, restarts nothing and leaks no KV block.

Each test sends its attack from raw DEALER sockets while (or before) a normal request streams,
then checks that request against transformers' greedy output.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgspec
import pytest
import zmq

from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineError
from actorserve.messages.client import EngineToClient, ErrorReply, GenerateRequest
from actorserve.messages.codec import Decoder, encode
from actorserve.messages.common import SamplingParams
from support import EngineServer, hf_greedy, prompts_of_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
FLOOD_S = 5.0  # past the 3 heartbeat intervals (1 s each) a silent actor is killed after


@pytest.fixture(scope="module")
def engine(llama_dir):
    server = EngineServer(
        llama_dir,
        "--max-model-len",
        "1024",
        "--max-request-output-tokens",
        "16384",
        "--max-logprob-entries",
        "100000",
    )
    yield server
    assert server.stop() == 0


def restarts(server: EngineServer) -> dict[str, int]:
    return {a.name: a.restarts for a in server.client.health().actors}


def fuzz_frames(seed: int, count: int) -> list[list[bytes]]:
    """`count` messages no Engine can take, each a list of frames: random bytes, truncated and
    deeply nested msgpack, the client protocol's messages with wrong types and huge lists, and
    multi-frame junk (which a ROUTER gets as more than one frame after the identity)."""
    rng = random.Random(seed)
    valid = encode(GenerateRequest("v", "hello", params=SamplingParams(max_tokens=3)))
    wrong_types = [
        {"type": "GenerateRequest", "request_id": 7, "prompt": "x"},
        {"type": "GenerateRequest", "request_id": "w", "prompt": ["x"]},
        {"type": "GenerateRequest", "request_id": "w", "prompt": "x", "params": [1, 2]},
        {"type": "GenerateRequest", "request_id": "w", "prompt": "x", "params": {"n": "many"}},
        {"type": "GenerateRequest", "request_id": "w", "prompt_token_ids": [-1, 2**63]},
        {"type": "GenerateRequest", "request_id": "w", "prompt": "x", "priority": 2**40},
        {"type": "GenerateRequest", "request_id": "w", "prompt": "x", "resume": [{"index": -1}]},
        {"type": "AbortRequest", "request_id": None},
        {"type": "Ping", "request_ids": "abc"},
        {"type": "HealthRequest"},
        {"type": "NoSuchMessage"},
        {"type": 17},
        [],
        None,
    ]
    huge = [
        {"type": "GenerateRequest", "request_id": "h", "prompt_token_ids": [1] * 200_000},
        {
            "type": "GenerateRequest",
            "request_id": "h",
            "prompt": "x",
            "params": {"stop_token_ids": [0] * 300_000},
        },
        {
            "type": "GenerateRequest",
            "request_id": "h",
            "prompt": "x",
            "params": {"logit_bias": {str(i): 1.0 for i in range(50_000)}},
        },
        {"type": "GenerateRequest", "request_id": "h", "prompt": "x" * 3_000_000},
    ]
    frames = []
    for i in range(count):
        kind = i % 6
        if kind == 0:
            data = rng.randbytes(rng.randrange(0, 300))
        elif kind == 1:
            data = valid[: rng.randrange(0, len(valid))]
        elif kind == 2:
            depth = rng.choice([100, 1000, 10_000, 200_000])
            data = rng.choice([b"\x91", b"\x81\xa1a", b"\xdc\x00\x01"]) * depth + b"\xc0"
        elif kind == 3:
            data = msgspec.msgpack.encode(rng.choice(wrong_types))
        elif kind == 4:
            data = msgspec.msgpack.encode(huge[i // 60 % len(huge)]) if i % 60 == 4 else valid[:-1]
        else:
            frames.append([rng.randbytes(8) for _ in range(rng.randrange(2, 5))])
            continue
        frames.append([data])
    return frames


def send_frames(address: str, frames: list[list[bytes]], timeout_s: float = 60.0) -> list:
    """Send every message on one DEALER, then collect the replies until `len(single-frame
    messages)` have come or the time is up."""
    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(address)
    decoder = Decoder(EngineToClient)
    replies = []
    expected = sum(len(f) == 1 for f in frames)
    try:
        for message in frames:
            socket.send_multipart(message)
        deadline = time.monotonic() + timeout_s
        while len(replies) < expected and time.monotonic() < deadline:
            if socket.poll(200):
                replies.append(decoder.decode(socket.recv()))
    finally:
        socket.close()
        ctx.term()
    return replies


def stream_while(address: str, prompts, attack) -> list[list[int]]:
    """Stream greedy completions of `prompts` while `attack()` runs on a thread."""

    async def run():
        async with AsyncClient(address, timeout_s=120) as client:

            async def one(prompt):
                return [t async for d in client.generate(prompt, GREEDY) for t in d.token_ids]

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            attacker = threading.Thread(target=attack)
            await asyncio.sleep(0.2)  # the streams are under way
            attacker.start()
            outputs = await asyncio.gather(*tasks)
            await asyncio.to_thread(attacker.join)
            return outputs

    return asyncio.run(run())


def test_two_thousand_fuzzed_frames_each_get_an_error_and_harm_nothing(llama_dir, engine):
    before = restarts(engine)
    frames = fuzz_frames(seed=21, count=2400)
    replies = send_frames(engine.address, frames)
    single = sum(len(f) == 1 for f in frames)
    assert len(replies) == single  # one answer per message it could read as one
    assert all(isinstance(r, ErrorReply) and r.code == "invalid_request" for r in replies)
    assert any("prompt_token_ids" in r.message for r in replies)
    assert any("stop_token_ids must hold at most 1024" in r.message for r in replies)
    prompt = prompts_of_lengths(llama_dir, [40])[0]
    assert engine.client.complete(prompt, GREEDY).token_ids == hf_greedy(llama_dir, prompt, 24)
    assert restarts(engine) == before


def test_a_deeply_nested_frame_and_a_gigabyte_frame_leave_streams_untouched(llama_dir, engine):
    before = restarts(engine)
    prompts = prompts_of_lengths(llama_dir, [30, 60])

    def attack():
        (nested,) = send_frames(engine.address, [[b"\x91" * 200_000 + b"\xc0"]])
        assert isinstance(nested, ErrorReply) and "invalid message" in nested.message
        # Over max_client_message_bytes: ZeroMQ drops the frame (and that connection) unread.
        assert send_frames(engine.address, [[bytes(1 << 30)]], timeout_s=3) == []

    outputs = stream_while(engine.address, prompts, attack)
    assert outputs == [hf_greedy(llama_dir, p, 24) for p in prompts]
    assert restarts(engine) == before


def test_a_flood_of_frames_past_three_heartbeats_kills_nothing_and_streams_finish(
    llama_dir, engine
):
    """Bad frames sent as fast as the Engine takes them (its socket's queue is bounded, so the
    sender waits on the reader) for longer than the supervisor waits for a heartbeat (three
    intervals of 1 s, the default): a read loop that starved the heartbeat would get the
    Engine killed. A flood of a fixed time, not of a fixed count, lasts that long on any
    machine."""
    before = restarts(engine)
    prompts = prompts_of_lengths(llama_dir, [20, 45, 70])
    sent = []

    def flood():
        ctx = zmq.Context()
        socket = ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(engine.address)
        count, end = 0, time.monotonic() + FLOOD_S
        while count % 1000 or time.monotonic() < end:
            socket.send(b"\x00", copy=True)  # never reads a reply: the Engine may not wait on it
            count += 1
        sent.append(count)
        socket.close()
        ctx.term()

    outputs = stream_while(engine.address, prompts, flood)
    assert sent, "the flood did not finish"
    assert outputs == [hf_greedy(llama_dir, p, 24) for p in prompts]
    assert restarts(engine) == before  # no actor was killed as hung


def test_four_8mb_prompts_get_a_clear_error_while_streams_finish(llama_dir, engine):
    before = restarts(engine)
    prompts = prompts_of_lengths(llama_dir, [25, 50])
    errors = []

    def attack():
        async def big(i):
            async with AsyncClient(engine.address, timeout_s=60) as client:
                try:
                    await client.complete_all("lorem ipsum " * 700_000, GREEDY)
                except EngineError as exc:
                    errors.append(exc)

        async def four():
            await asyncio.gather(*[big(i) for i in range(4)])

        asyncio.run(four())

    outputs = stream_while(engine.address, prompts, attack)
    assert outputs == [hf_greedy(llama_dir, p, 24) for p in prompts]
    assert len(errors) == 4
    assert all(e.code == "invalid_request" and "max_model_len=1024" in str(e) for e in errors)
    assert restarts(engine) == before


@pytest.mark.parametrize(
    "params, named",
    [
        (
            {"n": 64, "max_tokens": 64, "min_tokens": 64, "stop_token_ids": [0] * 3_500_000},
            "stop_token_ids",
        ),
        ({"n": 64, "max_tokens": 1 << 20}, "max_request_output_tokens"),
        ({"n": 8, "max_tokens": 1000, "logprobs": 20}, "max_logprob_entries"),
    ],
    ids=["stop_token_ids", "n_x_max_tokens", "logprobs"],
)
def test_requests_asking_too_much_get_an_error_naming_the_limit(engine, params, named):
    before = restarts(engine)
    request = {"type": "GenerateRequest", "request_id": "big", "prompt": "hi", "params": params}
    (error,) = send_frames(engine.address, [[msgspec.msgpack.encode(request)]])
    assert isinstance(error, ErrorReply) and error.code == "invalid_request"
    assert named in error.message and error.request_id == "big"
    assert engine.client.complete("Hello", SamplingParams(max_tokens=3)).completion_tokens == 3
    assert restarts(engine) == before


def test_clients_cannot_jump_the_queue_by_default(engine):
    async def ask(priority: int):
        async with AsyncClient(engine.address, timeout_s=30) as client:
            return await client.complete_all("hi", SamplingParams(max_tokens=2), priority)

    with pytest.raises(EngineError) as info:
        asyncio.run(ask(-1))
    assert info.value.code == "invalid_request"
    assert "priority must be in [0, 1048576]" in str(info.value)
    assert asyncio.run(ask(3))[0].completion_tokens == 2  # lowering one's own priority is fine
