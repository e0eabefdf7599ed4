"""The ZeroMQ client SDK's blocking `Client`: an `AsyncClient` (client.py, which says how streams,
pings, resumes and failures work) driven on an event loop thread of its own, so that code with no
event loop can stream a completion with a plain `for` loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from ..messages.client import Delta, HealthReply
from ..messages.common import SamplingParams
from .client import AsyncClient


class Client:
    """Blocking wrapper: an AsyncClient on a private event loop thread."""

    def __init__(self, address: str, **options):
        """`options`: AsyncClient's (timeout_s, ping_interval_s, liveness_timeout_s,
        server_public_key, client_keys)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="actorserve-client"
        )
        self._thread.start()
        self._async = self._call(self._make(address, options))

    @staticmethod
    async def _make(address: str, options: dict) -> AsyncClient:
        return AsyncClient(address, **options)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Iterator[Delta]:
        stream = self._async.generate(prompt, params, request_id, priority)
        try:
            while True:
                try:
                    yield self._call(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(stream.aclose())

    def complete(self, prompt: str | list[int], params: SamplingParams | None = None) -> Delta:
        """The whole completion as one Delta (text, token ids and logprobs joined); with n > 1,
        sample 0 (see `complete_all`)."""
        return self.complete_all(prompt, params)[0]

    def complete_all(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> list[Delta]:
        """Every sample of the request (`params.n` of them) as one joined Delta, by index."""
        return self._call(self._async.complete_all(prompt, params))

    def abort(self, request_id: str) -> None:
        self._call(self._async.abort(request_id))

    def health(self, timeout_s: float = 10.0) -> HealthReply:
        return self._call(self._async.health(timeout_s))

    def close(self) -> None:
        self._call(self._async.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
