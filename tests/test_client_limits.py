"""What one client may hold in the Engine, for clients of the SDK straight on its socket: live
requests (samples) up to max_client_requests, output tokens (n x max_tokens) up to
max_client_output_tokens. Over either, an ErrorReply the SDK raises as EngineError with code
`rate_limit_exceeded`, naming the limit; other clients, and other tenants a sender names, hold
their own shares; nothing of a refused request is left in the engine."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineError
from actorserve.messages.common import SamplingParams
from support import EngineServer

PROMPT = [5, 6, 7, 8, 9]


def held(max_tokens: int, n: int = 1) -> SamplingParams:
    """A request that runs until its client leaves it."""
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir):
    server = EngineServer(
        llama_dir, "--max-client-requests", "3", "--max-client-output-tokens", "2000"
    )
    yield server
    assert server.stop() == 0


async def hold(client: AsyncClient, params: SamplingParams, tenant: str | None = None):
    """Start a request and wait for its first delta: it is live in the engine until the
    returned stream is closed (which aborts it)."""
    stream = client.generate(PROMPT, params, tenant=tenant)
    await stream.__anext__()
    return stream


async def refusal(client: AsyncClient, params: SamplingParams, tenant=None) -> EngineError:
    with pytest.raises(EngineError) as refused:
        async for _ in client.generate(PROMPT, params, tenant=tenant):
            pass
    return refused.value


async def release(client: AsyncClient, streams) -> None:
    """Leave the streams (the SDK aborts their requests), and wait until the engine has had
    the aborts: a health query behind them on the socket comes back after they are done."""
    for stream in streams:
        await stream.aclose()
    await asyncio.sleep(0)  # the SDK sends each abort from a task of its own
    await client.health()


def test_a_client_over_its_live_requests_is_refused_naming_the_limit_and_others_are_not(engine):
    async def run():
        async with AsyncClient(engine.address) as a, AsyncClient(engine.address) as b:
            streams = [await hold(a, held(500)), await hold(a, held(500, n=2))]  # 3 samples
            error = await refusal(a, held(10))
            assert error.code == "rate_limit_exceeded"
            assert "has 3 live requests (samples)" in str(error)
            assert "max_client_requests=3" in str(error)
            # another client (another socket) has a share of its own
            done = [d async for d in b.generate(PROMPT, SamplingParams(max_tokens=4))]
            assert done[-1].finish_reason == "length"
            await release(a, streams)
            # what the refused and the aborted requests held is given back
            done = [d async for d in a.generate(PROMPT, held(4, n=3))]
            assert sum(d.finished for d in done) == 3

    asyncio.run(run())


def test_a_client_over_its_reserved_output_tokens_is_refused_naming_the_limit(engine):
    async def run():
        async with AsyncClient(engine.address) as a:
            streams = [await hold(a, held(1500))]
            error = await refusal(a, held(300, n=2))
            assert error.code == "rate_limit_exceeded"
            assert "may generate 1500 tokens and this one 600" in str(error)
            assert "max_client_output_tokens=2000" in str(error)
            done = [d async for d in a.generate(PROMPT, SamplingParams(max_tokens=500))]
            assert done[-1].completion_tokens == 500  # 1500 + 500: at the limit, not over
            await release(a, streams)

    asyncio.run(run())


def test_each_tenant_a_sender_names_is_a_client_of_its_own_within_that_sender(engine):
    async def run():
        async with AsyncClient(engine.address) as gateway, AsyncClient(engine.address) as other:
            streams = [await hold(gateway, held(100), tenant="key:a") for _ in range(3)]
            error = await refusal(gateway, held(10), tenant="key:a")
            assert "max_client_requests=3" in str(error)
            streams.append(await hold(gateway, held(100), tenant="key:b"))
            # the same tenant from another sender is another client: it spends nothing of
            # what the first sender's "key:a" holds, and is not held back by it
            done = [d async for d in other.generate(PROMPT, held(4), tenant="key:a")]
            assert done[-1].completion_tokens == 4
            await release(gateway, streams)
            error = await refusal(gateway, held(10), tenant="t" * 129)
            assert error.code == "invalid_request"
            assert "tenant must be at most 128 characters" in str(error)

    asyncio.run(run())
