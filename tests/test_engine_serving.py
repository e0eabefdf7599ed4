"""Serving behaviour through the real processes: seeds, aborts, bad input, the process tree, CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import msgspec
import pytest

from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineError
from actorserve.messages.client import ErrorReply, GenerateRequest
from actorserve.messages.codec import encode
from actorserve.messages.common import SamplingParams
from support import (
    EngineServer,
    generate_concurrently,
    hf_greedy,
    prompts_of_lengths,
    raw_exchange,
    tokenizer,
)


@pytest.fixture(scope="module")
def engine(llama_dir):
    server = EngineServer(llama_dir, "--max-model-len", "1024")
    yield server
    assert server.stop() == 0


def test_same_seed_gives_same_tokens_alone_and_inside_a_batch(llama_dir, engine):
    prompts = prompts_of_lengths(llama_dir, [12, 40, 7, 90, 3, 60])
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True
    )
    ((_, alone, _),) = generate_concurrently(engine.address, [prompts[0]], seeded)
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)

    async def batch():
        async with AsyncClient(engine.address, timeout_s=60) as client:

            async def collect(prompt, params):
                return [t async for d in client.generate(prompt, params) for t in d.token_ids]

            others = [collect(p, unseeded) for p in prompts[1:]]
            return await asyncio.gather(collect(prompts[0], seeded), *others)

    in_batch = asyncio.run(batch())[0]
    assert in_batch == alone and len(alone) == 20
    ((_, other_seed, _),) = generate_concurrently(
        engine.address, [prompts[0]], msgspec.structs.replace(seeded, seed=99)
    )
    assert other_seed != alone


def test_streamed_text_is_the_decoded_tokens_split_only_between_characters(llama_dir, engine):
    prompt = "Größe: 🚀 naïve café — 東京 "
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    pieces = []

    async def run():
        async with AsyncClient(engine.address, timeout_s=60) as client:
            async for delta in client.generate(prompt, params):
                pieces.append(delta)

    asyncio.run(run())
    ids = [t for d in pieces for t in d.token_ids]
    full = tokenizer(llama_dir).decode(ids, skip_special_tokens=True)
    streamed = "".join(d.text for d in pieces)
    # A random model may emit invalid bytes (decoded as U+FFFD by both); splitting adds none,
    # and at most the bytes of one unfinished character are held back at the end.
    assert full.startswith(streamed) and len(full) - len(streamed) <= 1
    assert pieces[-1].finish_reason.value == "length" and pieces[-1].completion_tokens == 40


def test_abort_mid_stream_ends_with_abort_and_frees_every_block(llama_dir, engine):
    prompt = prompts_of_lengths(llama_dir, [300])[0]

    async def run():
        async with AsyncClient(engine.address, timeout_s=60) as client:
            deltas = []
            stream = client.generate(
                prompt,
                SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True),
                request_id="to-abort",
            )
            async for delta in stream:
                deltas.append(delta)
                if len(deltas) == 3:
                    await client.abort("to-abort")
            return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason.value == "abort"
    assert len(deltas) < 100
    stats = engine.wait_blocks_free()
    assert stats.blocks_free == stats.blocks_total and stats.num_running == 0


BAD_REQUESTS = [
    ({"prompt_token_ids": [5] * 1024}, "max_model_len"),
    ({"prompt": "hi", "params": {"max_tokens": 0}}, "max_tokens"),
    ({"prompt": "hi", "params": {"temperature": -0.5}}, "temperature"),
    ({"prompt": "hi", "params": {"top_p": 0.0}}, "top_p"),
    ({"prompt": "hi", "params": {"top_p": 1.5}}, "top_p"),
    ({"prompt": "hi", "params": {"temprature": 1.0}}, "temprature"),
    ({"prompt": "hi", "params": {"max_tokens": "ten"}}, "max_tokens"),
    ({"prompt": 42}, "prompt"),
    ({"prompt_token_ids": [1, 99999999]}, "vocab_size"),
    ({}, "prompt"),
]


@pytest.mark.parametrize("fields, named", BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_input_gets_a_clear_error_and_the_engine_keeps_serving(engine, fields, named):
    raw = msgspec.msgpack.encode({"type": "GenerateRequest", "request_id": "bad", **fields})
    error = raw_exchange(engine.address, raw)
    assert isinstance(error, ErrorReply)
    assert error.code == "invalid_request" and error.request_id == "bad"
    assert named in error.message
    ok = engine.client.complete("Hello", SamplingParams(max_tokens=3))
    assert ok.finish_reason.value == "length" and len(ok.token_ids) == 3


def test_garbage_bytes_on_the_client_socket_get_an_error_and_harm_nothing(engine):
    for garbage in [
        b"\xc1\xff\x00 definitely not msgpack",
        encode(GenerateRequest("x", "hi")) + b"trailing",
        msgspec.msgpack.encode({"type": "NoSuchMessage"}),
    ]:
        error = raw_exchange(engine.address, garbage)
        assert isinstance(error, ErrorReply) and error.code == "invalid_request"
        assert "invalid message" in error.message
    ok = engine.client.complete("Hello", SamplingParams(max_tokens=4))
    assert ok.completion_tokens == 4
    assert engine.proc.poll() is None


def test_sdk_raises_a_typed_error_for_a_refused_request(engine):
    async def run():
        async with AsyncClient(engine.address, timeout_s=30) as client:
            async for _ in client.generate("hi", SamplingParams(temperature=-1)):
                pass

    with pytest.raises(EngineError, match="temperature must be >= 0") as info:
        asyncio.run(run())
    assert info.value.code == "invalid_request"


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_four_actors_and_the_gateway_are_distinct_live_processes_under_the_supervisor(engine):
    actors = {a.name: a for a in engine.client.health().actors}
    assert set(actors) == {"engine", "scheduler", "block_manager", "worker", "gateway"}
    pids = {a.pid for a in actors.values()}
    assert len(pids) == 5 and engine.proc.pid not in pids
    for actor in actors.values():
        assert actor.state == "ready"
        os.kill(actor.pid, 0)  # alive
        assert parent_pid(actor.pid) == engine.proc.pid


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_cli_refuses_an_on_off_flag_that_is_neither(llama_dir, value):
    out = subprocess.run(
        [sys.executable, "-m", "actorserve.cli", "serve", "--model", str(llama_dir)]
        + ["--enable-prefix-caching", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--enable-prefix-caching" in out.stderr and "expected true or false" in out.stderr


def test_cli_generate_streams_a_completion_through_a_running_engine(engine):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "actorserve.cli",
            "generate",
            "--address",
            engine.address,
            "--prompt",
            "def main():",
            "--max-tokens",
            "12",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "12 tokens" in out.stderr


def test_a_stop_string_ends_the_stream_there_and_frees_the_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = engine.client.complete("def main():", params)
    assert len(full.text) > 12
    stop = full.text[len(full.text) // 2 :][:3]
    cut = engine.client.complete("def main():", msgspec.structs.replace(params, stop=[stop]))
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason.value == "stop" and len(cut.token_ids) < 40
    kept = engine.client.complete(
        "def main():",
        msgspec.structs.replace(params, stop=[stop], include_stop_str_in_output=True),
    )
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(engine):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    full = engine.client.complete("def main():", params)
    assert full.finish_reason.value == "length" and full.text
    # The whole text as the stop string: it is complete only with the 8th token, the last one
    # max_tokens allows, and the stop string decides the finish reason.
    cut = engine.client.complete("def main():", msgspec.structs.replace(params, stop=[full.text]))
    assert cut.finish_reason.value == "stop" and cut.text == ""
    assert cut.token_ids == full.token_ids


def test_a_client_with_many_streams_gets_each_steps_deltas_in_one_message(engine):
    """Four requests on one DEALER: their deltas of a step come as one DeltaBatch, and every
    request still gets all its tokens, in order, ending with its finish reason."""
    import zmq

    from actorserve.messages.client import Delta, DeltaBatch, EngineToClient
    from actorserve.messages.codec import Decoder

    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 60_000)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rids = [f"batch-{i}" for i in range(4)]
    prompts = {rid: [1, 5 + i] * 3 for i, rid in enumerate(rids)}
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    finished: set[str] = set()
    batches = 0  # DeltaBatch messages; 12 tokens each, so 12 steps with all four decoding
    try:
        socket.connect(engine.address)
        for rid in rids:
            socket.send(encode(GenerateRequest(rid, prompt_token_ids=prompts[rid], params=params)))
        decoder = Decoder(EngineToClient)
        while finished != set(rids):
            message = decoder.decode(socket.recv())
            batches += isinstance(message, DeltaBatch)
            deltas = message.deltas if isinstance(message, DeltaBatch) else [message]
            for delta in deltas:
                assert isinstance(delta, Delta) and delta.request_id not in finished
                tokens[delta.request_id] += delta.token_ids
                if delta.finished:
                    finished.add(delta.request_id)
    finally:
        socket.close()
        ctx.term()
    assert batches >= 12 - 4  # all but the steps where the four had not all started yet
    for rid in rids:  # the same tokens, in the same order, as the request alone
        assert tokens[rid] == engine.client.complete(prompts[rid], params).token_ids


def test_the_offline_api_returns_transformers_greedy_output_in_prompt_order(llama_dir):
    from actorserve import LLM

    prompts = prompts_of_lengths(llama_dir, [30, 5, 70])
    params = SamplingParams(temperature=0.0, max_tokens=10)
    with LLM(str(llama_dir), max_model_len=1024) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        (two,) = llm.generate(prompts[0], msgspec.structs.replace(params, n=2), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt == prompt and out.prompt_tokens == len(prompt)
        assert out.token_ids == hf_greedy(llama_dir, prompt, 10)
        assert out.finish_reason.value in ("stop", "length")
    assert [s.token_ids for s in two.samples] == [outputs[0].token_ids] * 2  # greedy samples


def test_requests_arriving_while_the_engine_streams_to_others_are_all_answered(engine):
    """The Engine reads new requests from the socket it streams deltas out of: one arriving
    during a send must still wake it (a send can consume the socket's edge-triggered signal)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def staggered():
        async with AsyncClient(engine.address, timeout_s=30, liveness_timeout_s=30) as client:

            async def one(i):
                await asyncio.sleep(0.015 * i)  # arrivals interleave with the running streams
                return [t async for d in client.generate([1, 7 + i, 3] * 4, params)
                        for t in d.token_ids]  # fmt: skip

            return await asyncio.gather(*(one(i) for i in range(40)))

    outputs = asyncio.run(staggered())
    assert [len(tokens) for tokens in outputs] == [24] * 40
