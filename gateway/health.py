"""GET /health (liveness) and GET /ready (readiness), each asking the Engine at most once per
`health_interval_s`.

    /health  the gateway answers and the Engine answers a HealthRequest (no generation) within
             health_timeout_s: 200 {"status": "ok"}, or "degraded" while an actor restarts (the
             supervisor is on it; a liveness check failing then would get the whole server
             killed); 503 when the Engine does not answer, or while draining.
    /ready   every actor is ready in /health's answer (the supervisor's roster: an actor is
             `restarting` from the moment its death is noticed), and one greedy token goes
             through every actor within health_timeout_s: 200 {"status": "ok", "probe_s"};
             503 {"status": "degraded" | "unavailable"} otherwise. While an actor is down it
             answers from the roster at once, not after a probe that waits out the restart.

Both are open (load balancers call them without the API key), so the actors' PIDs and the
Engine's counters are in the body only for a caller that sends the key, or when none is set.
Callers within one interval share the last answer (`age_s` says how old it is): a flood of
either costs the Engine one round trip, or one token, per interval. A check runs in a task of
its own, so a caller that goes away does not cancel it for the others.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import msgspec
from fastapi.responses import Response

from ..messages.client import HealthReply
from ..messages.common import SamplingParams
from .errors import EngineError, EngineUnavailable
from .openai_routes import json_response
from .replicas import ReplicaSet
from .service import GatewaySettings


@dataclass
class Answer:
    status: int  # HTTP status
    public: dict  # for every caller
    private: dict = field(default_factory=dict)  # actors (PIDs) and counters: key holders only
    at: float = field(default_factory=time.monotonic)  # when it was found out


T = TypeVar("T")


class RateLimited(Generic[T]):
    """`check()`'s answer, run at most once per `interval_s` and never twice at once."""

    def __init__(self, check: Callable[[], Awaitable[T]], interval_s: float):
        self.check = check
        self.interval_s = interval_s
        self._task: asyncio.Task[T] | None = None
        self._started = -math.inf

    async def get(self) -> T:
        now = time.monotonic()
        stale = self._task is None or (self._task.done() and now - self._started >= self.interval_s)
        if stale:
            self._started = now
            self._task = asyncio.get_running_loop().create_task(self.check())
            # retrieved here too, so a failure nobody waited for is not logged as lost
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._task)


class HealthChecks:
    def __init__(self, client: ReplicaSet, settings: GatewaySettings):
        self.client = client
        self.settings = settings
        self.liveness = RateLimited(self._liveness, settings.health_interval_s)
        self.readiness = RateLimited(self._readiness, settings.health_interval_s)

    async def respond(
        self, check: Callable[[], Awaitable[Answer]], draining: bool, authorized: bool
    ) -> Response:
        """`check`: `live` or `ready`."""
        if draining:
            return json_response(
                {"status": "draining", "error": "the server is shutting down"}, 503
            )
        answer = await check()
        body = {**answer.public, "age_s": round(time.monotonic() - answer.at, 3)}
        if authorized:
            body.update(answer.private)
        return json_response(body, answer.status)

    async def live(self) -> Answer:
        return await self.liveness.get()

    async def ready(self) -> Answer:
        """/health's answer while the Engine does not answer or an actor is not ready (503),
        else the probe's."""
        live = await self.liveness.get()
        if live.status != 200:
            return live
        if live.public["status"] != "ok":
            down = [a for a in live.private["actors"] if a["state"] != "ready"]
            error = ", ".join(f"{a['name']} {a['state']}" for a in down) or "no engine stats"
            return Answer(503, {"status": "degraded", "error": error}, live.private, live.at)
        return await self.readiness.get()

    def _unavailable(self, exc: EngineError) -> dict:
        """The public error of a failed check. The SDK's own timeouts name the Engine's address,
        which is not for everyone: those say which limit ran out instead."""
        if isinstance(exc, EngineUnavailable):
            timeout = self.settings.health_timeout_s
            message = f"no answer from the engine within health_timeout_s={timeout:g} s"
        else:
            message = str(exc)
        return {"status": "unavailable", "error": message}

    async def _liveness(self) -> Answer:
        try:
            reply = await self.client.health(self.settings.health_timeout_s)
        except EngineError as exc:
            return Answer(503, self._unavailable(exc), {"detail": str(exc)})
        return Answer(200, {"status": "ok" if reply.ok else "degraded"}, _private(reply))

    async def _readiness(self) -> Answer:
        try:
            elapsed, reply = await self.probe()
        except EngineError as exc:
            private: dict = {"detail": str(exc), "actors": []}
            try:
                private["actors"] = msgspec.to_builtins((await self.client.health(1.0)).actors)
            except EngineError:
                pass
            return Answer(503, self._unavailable(exc), private)
        public = {"status": "ok" if reply.ok else "degraded", "probe_s": round(elapsed, 4)}
        return Answer(200 if reply.ok else 503, public, _private(reply))

    async def probe(self) -> tuple[float, HealthReply]:
        """Push one greedy token through every actor; (seconds it took, health reply)."""
        started = time.perf_counter()
        timeout = self.settings.health_timeout_s
        rid = f"health-{os.urandom(6).hex()}"
        stream = self.client.generate(
            "health", SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), rid
        )

        async def one_token() -> None:
            async for _ in stream:  # the SDK's stream ends once the request has finished
                pass

        try:
            await asyncio.wait_for(one_token(), timeout)
        except asyncio.TimeoutError:
            raise EngineError(
                f"no token from the engine within {timeout:g} s (health_timeout_s)", "unavailable"
            ) from None
        finally:
            await stream.aclose()  # aborts it in the Engine if it did not finish
        elapsed = time.perf_counter() - started
        return elapsed, await self.client.health(timeout)


def _private(reply: HealthReply) -> dict:
    return {
        "actors": msgspec.to_builtins(reply.actors),
        "engine": msgspec.to_builtins(reply.stats),
    }
