"""The SDK's `timeout_s` is the longest wait for any message of a request, streamed or whole."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineUnavailable
from actorserve.messages.client import ClientToEngine, Delta
from actorserve.messages.codec import Decoder, encode


def engine_that_goes_quiet(address: str, started: threading.Event) -> None:
    """A fake Engine: answers the first request with one delta, then never again."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    started.set()
    try:
        identity, data = router.recv_multipart()
        request = Decoder(ClientToEngine).decode(data)
        time.sleep(0.05)
        router.send_multipart([identity, encode(Delta(request.request_id, "a", [1]))])
        router.poll(3000)  # then silence (a ping may come; it gets no answer)
    finally:
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("whole", [True, False], ids=["complete_all", "generate"])
async def test_silence_after_a_delta_fails_the_request_one_timeout_after_that_delta(
    tmp_path, whole
):
    address = f"ipc://{tmp_path}/engine.sock"
    started = threading.Event()
    engine = threading.Thread(target=engine_that_goes_quiet, args=(address, started))
    engine.start()
    started.wait(5)
    timeout = 1.0
    async with AsyncClient(address, timeout_s=timeout, liveness_timeout_s=30) as client:
        start = time.monotonic()
        with pytest.raises(EngineUnavailable):
            if whole:
                await client.complete_all([1, 2, 3])
            else:
                async for _ in client.generate([1, 2, 3]):
                    pass
        waited = time.monotonic() - start
    engine.join(10)
    # the delta came at ~0.05 s: the request fails ~1 timeout later, not a whole window after
    assert timeout <= waited < 1.6 * timeout
