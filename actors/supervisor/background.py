"""A supervisor on an event loop thread of its own, for synchronous callers (CLI, offline API)."""

from __future__ import annotations

import asyncio
import threading

from ..runtime.config import EngineConfig
from .supervisor import Supervisor


class BackgroundSupervisor:
    """A supervisor on its own event loop thread, for synchronous callers (CLI, offline API)."""

    def __init__(self, config: EngineConfig, client_address: str | None = None):
        self._config = config
        self._client_address = client_address
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="supervisor"
        )
        self.supervisor: Supervisor | None = None

    def start(self) -> str:
        """Start the actors; return the client address. Raises SupervisorError on failure."""
        self._thread.start()

        async def _start() -> Supervisor:
            supervisor = Supervisor(self._config, self._client_address)
            await supervisor.start()
            return supervisor

        self.supervisor = asyncio.run_coroutine_threadsafe(_start(), self._loop).result()
        return self.supervisor.client_address

    def stop(self) -> None:
        if self.supervisor is not None:
            asyncio.run_coroutine_threadsafe(self.supervisor.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> BackgroundSupervisor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
