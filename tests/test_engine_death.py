"""The Engine's death loses nothing: the SDK re-submits every stream it was receiving as a
resumption (GenerateRequest.resume), so seeded samples and HTTP streams through the gateway
complete exactly as in a fault-free run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

from gateway_support import GatewayServer, open_stream, read_events

from actorserve.gateway.client import AsyncClient
from actorserve.messages.common import SamplingParams
from support import prompts_of_lengths, smallest_greedy_margin

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, n=2, max_tokens=40)


def engine_pid(server) -> int:
    return next(a.pid for a in server.client.health().actors if a.name == "engine")


def engine_restarts(server) -> int:
    return next(a.restarts for a in server.client.health().actors if a.name == "engine")


async def sampled(address: str, prompt, kill=None) -> dict[int, list[int]]:
    """Each sample's token ids; `kill()` once 10 tokens have arrived."""
    outputs: dict[int, list[int]] = {}
    async with AsyncClient(address, timeout_s=120) as client:
        async for delta in client.generate(prompt, SEEDED):
            outputs.setdefault(delta.index, []).extend(delta.token_ids)
            if kill and sum(map(len, outputs.values())) >= 10:
                kill, once = None, kill
                await asyncio.to_thread(once)
    return outputs


def test_seeded_samples_resumed_after_an_engine_sigkill_equal_the_fault_free_run(llama_dir):
    server = GatewayServer(llama_dir)
    try:
        prompt = prompts_of_lengths(llama_dir, [37])[0]
        fault_free = asyncio.run(sampled(server.address, prompt))
        pid = engine_pid(server)
        resumed = asyncio.run(sampled(server.address, prompt, lambda: os.kill(pid, signal.SIGKILL)))
        assert resumed == fault_free
        assert engine_restarts(server) == 1
    finally:
        assert server.stop() == 0


def http_streams(server, prompts, kill_engine: bool) -> list[tuple[str, str, str]]:
    """Stream every prompt at once over SSE; (text, finish reason, last event) of each.
    With `kill_engine`, SIGKILL the Engine once every stream has had its first events."""
    pid = engine_pid(server)
    started = threading.Barrier(len(prompts) + 1)
    results: list = [None] * len(prompts)

    def stream(i: int) -> None:
        body = {
            "model": server.model_name,
            "prompt": prompts[i],
            "max_tokens": 48,
            "temperature": 0,
            "stream": True,
        }
        conn, response = open_stream(server, "/v1/completions", body)
        events = read_events(response, 3)
        started.wait()
        events += read_events(response)
        conn.close()
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        results[i] = (
            "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
            next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"]),
            events[-1],
        )

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    started.wait()  # every stream is under way
    if kill_engine:
        os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    return results


def test_http_streams_survive_an_engine_sigkill_with_identical_output(llama_dir):
    server = GatewayServer(llama_dir)
    try:
        prompts = prompts_of_lengths(llama_dir, [12, 20, 33, 44, 50, 63, 70, 88])
        assert all(smallest_greedy_margin(llama_dir, p, 48) > 1e-3 for p in prompts)
        fault_free = http_streams(server, prompts, kill_engine=False)
        assert all(reason in ("stop", "length") for _, reason, _ in fault_free)
        assert http_streams(server, prompts, kill_engine=True) == fault_free
        assert engine_restarts(server) == 1
    finally:
        assert server.stop() == 0
