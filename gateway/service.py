"""What every route shares: the SDK client, admission (limit, drain), metrics, and one generate.

`Gateway.generate` is the only way a route reaches the Engine. It admits the request (503 while
draining, 429 over the concurrency limit or over what one client may hold, client_limits.py),
streams the SDK's deltas, records the request's latencies, maps the Engine's refusals to API
errors, and aborts the request in the Engine whenever its consumer goes away before the end
(client disconnect, cancel, error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ..messages.client import Delta
from ..messages.common import OutputKind, SamplingParams, max_prompt_chars
from .client_limits import ClientLimits, client_name
from .errors import EngineError
from .metrics import KvIndexReading, Metrics, ReplicaReading
from .openai_errors import RETRY_AFTER, APIError, invalid
from .openai_logprobs import TokenNames
from .openai_requests import ChatMessage
from .replicas import ReplicaSet
from .settings import GatewaySettings

SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)
ENGINE_STATUS = {
    "invalid_request": 400,
    "overloaded": 429,
    "rate_limit_exceeded": 429,
    "unavailable": 503,
}


INT64 = range(-(2**63), 2**63)


def check_int64(
    prompt: str | list[int], params: SamplingParams, prompt_param: str, priority: int
) -> None:
    """A 400 naming the field whose integer does not fit the wire's 64 bits. JSON integers
    have no size, and the ranges SamplingParams.validate checks leave some open above (top_k,
    priority): unchecked, such a number failed to encode in the SDK, a 500."""
    fields = [(prompt_param, prompt if isinstance(prompt, list) else []), ("priority", [priority])]
    for name in SamplingParams.__struct_fields__:
        value = getattr(params, name)
        fields.append((name, value if isinstance(value, (list, dict)) else [value]))
    for name, values in fields:
        for v in values:  # a dict's keys: logit_bias token ids
            if isinstance(v, int) and v not in INT64:
                raise invalid(f"{name} must fit in 64 bits (-2**63 <= n < 2**63)", name)


def engine_error(
    exc: EngineError, prompt_param: str = "prompt", structured_param: str = "structured"
) -> APIError:
    """The Engine's ErrorReply as an API error; its message starts with the field it names
    (`structured` is renamed to the request field the constraint came from)."""
    status = ENGINE_STATUS.get(exc.code, 500)
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":")
    param = (
        prompt_param
        if first in ("prompt", "prompt_token_ids")
        else (first if first in SAMPLING_FIELDS else None)
    )
    if param == "structured" and structured_param != param:
        param, message = structured_param, structured_param + message[len("structured") :]
    retry = RETRY_AFTER if status in (429, 503) else None
    return APIError(status, message, param, exc.code, retry)


class Gateway:
    def __init__(self, client: ReplicaSet, settings: GatewaySettings, chat):
        self.client = client
        self.settings = settings
        self.chat = chat  # ChatTemplate
        self.token_names = TokenNames(chat.tokenizer)  # token id -> text, for logprobs
        self.metrics = Metrics(settings.model_id)
        self.active = 0
        self.clients = ClientLimits(
            settings.max_client_requests, settings.max_client_output_tokens, settings.max_model_len
        )
        self.draining = False
        # the server's open connections (uvicorn's set, HTTPGateway fills it in): WebSocket
        # handshakes are counted against max_connections here, uvicorn counts HTTP requests
        self.connections: set = set()
        self.metrics.watch(lambda: self.active, lambda: len(self.connections))
        self.metrics.watch_replicas(
            lambda: [
                ReplicaReading(r.index, r.routed, r.in_flight, r.up, r.step_cost)
                for r in client.replicas
            ]
        )
        kv = client.kv
        if kv is not None:
            self.metrics.watch_kv_indexes(
                lambda: [
                    KvIndexReading(i, len(x.blocks), x.usable, x.newest_ts, x.resyncs)
                    for i, x in enumerate(kv.indexes)
                ],
                lambda: (kv.by_cache, kv.fallbacks),
            )
        self._idle = asyncio.Event()
        self._idle.set()

    # -- admission ---------------------------------------------------------------------------

    def client_of(self, headers, peer, subprotocols=()) -> str:
        """Whom a request counts for: its API key, else its peer address (client_limits.py)."""
        return client_name(self.settings.api_key, headers, peer, subprotocols)

    def _admit(self, client: str, samples: int, tokens: int) -> None:
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
        self.clients.take(client, samples, tokens)
        self.active += 1
        self._idle.clear()

    def check_batch(self, count: int, client: str, params: SamplingParams) -> None:
        """Before a batch of `count` prompts, each with `params`, starts: a 400 when it can
        never run (over max_batch_prompts, or more than max_concurrent_requests at once), a 429
        when it cannot run now (in all, or for its client); so no prompt of it starts only to
        be aborted when a later one is refused."""
        if count <= 1:
            return
        limit = self.settings.max_concurrent_requests
        limits = {"max_batch_prompts": self.settings.max_batch_prompts}
        limits["max_concurrent_requests"] = limit
        for name, most in limits.items():
            if count > most:
                raise invalid(f"prompt: a batch of {count} prompts is over {name}={most}", "prompt")
        if self.active + count > limit:
            raise APIError(
                429,
                f"a batch of {count} prompts would be over max_concurrent_requests={limit} with "
                f"the {self.active} in flight; retry shortly",
                None,
                "rate_limit_exceeded",
                RETRY_AFTER,
            )
        samples, tokens = self.clients.reserved(params)
        self.clients.check(client, count * samples, count * tokens)

    def _release(self, client: str, samples: int, tokens: int) -> None:
        self.clients.give_back(client, samples, tokens)
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

    async def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        """The prompt token ids of a chat through the checkpoint's template; a 400 naming
        `messages` when the template refuses them. Rendering and tokenizing run in a thread:
        a prompt of megabytes takes the CPU for a while (`tokenizers` lets go of the GIL, the
        template's Jinja mostly does not, but it is linear), and the event loop must go on
        serving every other connection meanwhile."""
        chat = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)]
        limit = max_prompt_chars(self.chat.longest_token_chars, self.settings.max_model_len)
        chars = sum(len(m["content"]) for m in chat)
        if chars > limit:
            raise invalid(
                f"messages hold {chars} characters, more than max_model_len="
                f"{self.settings.max_model_len} tokens can hold with this tokenizer (at most "
                f"{limit} characters)",
                "messages",
            )
        try:
            return await asyncio.to_thread(self.chat.prompt_ids, chat, add_generation_prompt)
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        prompt_param: str = "prompt",
        priority: int = 0,
        structured_param: str = "structured",
        *,
        client: str,
    ) -> AsyncIterator[Delta]:
        """Deltas of one request (of its n samples, by `Delta.index`); raises APIError.
        Leaving before all n samples finished aborts it in the Engine (the SDK does).
        `structured_param`: the request field params.structured came from (named in errors).
        `client`: whom it counts for (`client_of`), here and in the Engine (its tenant)."""
        check_int64(prompt, params, prompt_param, priority)
        error = params.validate(self.settings.vocab_size)
        if error:
            raise engine_error(
                EngineError(error, "invalid_request"), prompt_param, structured_param
            )
        samples, tokens = self.clients.reserved(params)
        self._admit(client, samples, tokens)
        arrival = time.perf_counter()
        first: float | None = None
        last: Delta | None = None
        longest = 0
        streamed = params.output_kind is OutputKind.DELTA  # else no first-token time to see
        stream = self.client.generate(prompt, params, request_id, priority, tenant=client)
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
            raise engine_error(exc, prompt_param, structured_param) from None
        finally:
            self._release(client, samples, tokens)
            await stream.aclose()  # the SDK aborts a request left before it finished
