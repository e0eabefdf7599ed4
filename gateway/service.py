"""What every route shares: the SDK client, admission (limit, drain), metrics, and one generate.

`Gateway.generate` is the only way a route reaches the Engine. It admits the request (503 while
draining, 429 over the concurrency limit), streams the SDK's deltas, records the request's
latencies, maps the Engine's refusals to API errors, and aborts the request in the Engine
whenever its consumer goes away before the end (client disconnect, cancel, error).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import msgspec

from ..messages.client import Delta, HealthReply
from ..messages.common import OutputKind, SamplingParams
from .client import AsyncClient, EngineError
from .metrics import Metrics
from .openai_logprobs import TokenNames
from .openai_protocol import APIError, ChatMessage, invalid

SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)
ENGINE_STATUS = {"invalid_request": 400, "overloaded": 429, "unavailable": 503}
RETRY_AFTER = {"Retry-After": "1"}


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


class GatewaySettings(msgspec.Struct, kw_only=True):
    model_id: str  # the name clients pass as `model`
    model_dir: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    max_concurrent_requests: int = 1024
    max_body_bytes: int = 8 * 1024 * 1024
    health_timeout_s: float = msgspec.field(
        default_factory=lambda: _env_float("ACTORSERVE_HEALTH_TIMEOUT_S", 10.0)
    )

    def accepts_model(self, name: str | None) -> bool:
        return name is None or name in (self.model_id, os.path.basename(self.model_id.rstrip("/")))


def engine_error(exc: EngineError, prompt_param: str = "prompt") -> APIError:
    """The Engine's ErrorReply as an API error; its message starts with the field it names."""
    status = ENGINE_STATUS.get(exc.code, 500)
    first = str(exc).split(" ", 1)[0].rstrip(":")
    param = (
        prompt_param
        if first in ("prompt", "prompt_token_ids")
        else (first if first in SAMPLING_FIELDS else None)
    )
    retry = RETRY_AFTER if status in (429, 503) else None
    return APIError(status, str(exc), param, exc.code, retry)


class Gateway:
    def __init__(self, client: AsyncClient, settings: GatewaySettings, chat):
        self.client = client
        self.settings = settings
        self.chat = chat  # ChatTemplate
        self.token_names = TokenNames(chat.tokenizer)  # token id -> text, for logprobs
        self.metrics = Metrics(settings.model_id)
        self.active = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    # -- admission ---------------------------------------------------------------------------

    def _admit(self) -> None:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down and takes no new requests",
                None,
                "unavailable",
                RETRY_AFTER,
            )
        limit = self.settings.max_concurrent_requests
        if self.active >= limit:
            raise APIError(
                429,
                f"too many concurrent requests (max_concurrent_requests={limit}); retry shortly",
                None,
                "rate_limit_exceeded",
                RETRY_AFTER,
            )
        self.active += 1
        self._idle.clear()

    def _release(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight here; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # -- generation --------------------------------------------------------------------------

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True):
        """The prompt token ids of a chat through the checkpoint's template; a 400 naming
        `messages` when the template refuses them."""
        chat = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)]
        try:
            return self.chat.prompt_ids(chat, add_generation_prompt)
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        prompt_param: str = "prompt",
        priority: int = 0,
    ) -> AsyncIterator[Delta]:
        """Deltas of one request (of its n samples, by `Delta.index`); raises APIError.
        Leaving before all n samples finished aborts it in the Engine (the SDK does)."""
        error = params.validate(self.settings.vocab_size)
        if error:
            raise engine_error(EngineError(error, "invalid_request"), prompt_param)
        self._admit()
        arrival = time.perf_counter()
        first: float | None = None
        last: Delta | None = None
        longest = 0
        streamed = params.output_kind is OutputKind.DELTA  # else no first-token time to see
        stream = self.client.generate(prompt, params, request_id, priority)
        try:
            async for delta in stream:
                if first is None and streamed and delta.token_ids:
                    first = time.perf_counter()
                last = delta
                if delta.finished:
                    longest = max(longest, delta.completion_tokens)
                yield delta
            reason = last.finish_reason.value if last and last.finish_reason else "abort"
            self.metrics.observe(arrival, first, time.perf_counter(), longest, reason)
        except EngineError as exc:
            raise engine_error(exc, prompt_param) from None
        finally:
            self._release()
            await stream.aclose()  # the SDK aborts a request left before it finished

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
                f"no token from the engine within {timeout:g} s", "unavailable"
            ) from None
        finally:
            await stream.aclose()  # aborts it in the Engine if it did not finish
        elapsed = time.perf_counter() - started
        return elapsed, await self.client.health(timeout)
