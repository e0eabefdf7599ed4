"""Poison quarantine: a request that kills an actor on every try is failed after poison_crashes
crashes (one more when innocent requests ran beside it), the others complete, the server stays.
"""

from __future__ import annotations

import asyncio

import pytest

from actorserve.actors.engine.quarantine import Quarantine
from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineError
from actorserve.messages.common import SamplingParams
from support import EngineServer, hf_greedy, prompts_of_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def test_a_lone_request_in_flight_at_two_crashes_of_one_actor_is_failed():
    q = Quarantine(limit=2)
    assert q.crashed("worker", ["a"]) == (["a"], [])
    assert q.crashed("worker", ["a"]) == ([], ["a"])


def test_progress_between_crashes_or_another_actor_starts_the_count_again():
    q = Quarantine(limit=2)
    q.crashed("worker", ["a", "b"])
    q.progressed("a")
    assert q.crashed("scheduler", ["b"]) == (["b"], [])  # another actor: b's first of its crashes
    assert q.crashed("worker", ["a", "b"]) == (["a", "b"], [])  # a progressed; b: worker once


def test_suspects_in_flight_together_are_tried_one_at_a_time_and_the_culprit_failed():
    q = Quarantine(limit=2)
    q.crashed("worker", ["a", "p", "b"])
    resubmit, failed = q.crashed("worker", ["a", "p", "b", "new"])
    assert (resubmit, failed) == (["new"], [])  # three suspects held, the newcomer goes on
    assert q.next_probe() == "a" and q.next_probe() is None  # one on trial at a time
    assert q.progressed("a") and q.next_probe() == "p"
    q.progressed("new")
    assert q.crashed("worker", ["a", "new", "p"]) == (["a", "new"], ["p"])  # the probe crashed
    assert q.next_probe() == "b" and q.forget("b") and q.next_probe() is None


@pytest.fixture(scope="module")
def poisoned(llama_dir):
    """A server whose Worker dies on any plan that carries the poison token (a test-only fault)."""
    prompts = prompts_of_lengths(llama_dir, [20, 33, 47, 60])
    used = {t for p in prompts for t in p} | {
        t for p in prompts for t in hf_greedy(llama_dir, p, GREEDY.max_tokens)
    }
    poison = next(t for t in range(100, 1000) if t not in used)
    server = EngineServer(llama_dir, "--fault-crash-on-token-id", str(poison))
    yield server, prompts, poison
    assert server.stop() == 0


@pytest.mark.slow
def test_a_poison_request_is_failed_and_the_requests_beside_it_complete(llama_dir, poisoned):
    server, prompts, poison = poisoned

    async def run():
        async with AsyncClient(server.address, timeout_s=120) as client:

            async def one(prompt):
                try:
                    return [t async for d in client.generate(prompt, GREEDY) for t in d.token_ids]
                except EngineError as exc:
                    return exc

            innocents = [asyncio.create_task(one(p)) for p in prompts]
            return await one([5, poison, 7, 9]), await asyncio.gather(*innocents)

    failed, outputs = asyncio.run(run())
    assert isinstance(failed, EngineError) and failed.code == "internal"
    assert "poison_crashes=2" in str(failed) and "worker crashed" in str(failed)
    assert outputs == [hf_greedy(llama_dir, p, GREEDY.max_tokens) for p in prompts]
    assert server.proc.poll() is None
    worker = next(a for a in server.client.health().actors if a.name == "worker")
    assert 2 <= worker.restarts <= 3  # two crashes alone, or three with innocents beside it
    # and the server serves on
    prompt = prompts[0]
    assert server.client.complete(prompt, GREEDY).token_ids == hf_greedy(llama_dir, prompt, 16)
