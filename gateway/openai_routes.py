"""POST /v1/chat/completions, and what it shares with /v1/completions (openai_completions.py):
reading the body, the disconnect watch, SSE framing.

Streaming answers are Server-Sent Events framed as OpenAI frames them: `data: {json}\\n\\n` per
chunk, then `data: [DONE]\\n\\n`; with n > 1 the choices' chunks interleave, each naming its
`index`. The first delta (or the Engine's refusal) is awaited before the status line goes out, so
a refused request still gets its 4xx with OpenAI's error body. A client that disconnects
(streaming or not) aborts its request in the Engine. Logprobs take OpenAI's shapes
(openai_logprobs.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..messages.client import Delta
from ..messages.common import FinishReason
from .openai_errors import (
    APIError,
    decode_json,
    invalid,
)
from .openai_logprobs import chat_logprobs, prompt_logprobs
from .openai_requests import (
    ChatCompletionRequest,
)
from .openai_responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionWithPrompt,
    ChunkDelta,
    Usage,
    finish_reason,
    now,
)
from .request_stream import join_samples
from .service import Gateway, GatewaySettings

T = TypeVar("T")
_encoder = msgspec.json.Encoder()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(body, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), status, headers, media_type="application/json")


def error_response(error: APIError) -> Response:
    return json_response(error.body(), error.status, error.headers)


def sse(chunk) -> bytes:
    return b"data: " + _encoder.encode(chunk) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


_decoders: dict[type, msgspec.json.Decoder] = {}


def check_json_content_type(request: Request) -> None:
    """415 unless the body says it is JSON. Browsers send a cross-origin POST of another type
    (text/plain, forms) without asking the server first; one of application/json they do not."""
    given = request.headers.get("content-type", "")
    if given.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, got {given[:80]!r}",
            None,
            "unsupported_media_type",
        )


async def read_body(request: Request, kind: type[T], settings: GatewaySettings) -> T:
    """The JSON body decoded as `kind`: 415 if not said to be JSON, 413 over max_body_bytes
    (by Content-Length, and counted as it arrives, which is what bounds a chunked body), 408
    when it does not arrive within read_timeout_s, 400 naming the field otherwise."""
    check_json_content_type(request)
    max_bytes = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(
            413,
            f"request body is {declared} bytes, over the limit of {max_bytes} (max_body_bytes)",
            None,
            "request_too_large",
        )

    async def receive() -> bytearray:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise APIError(
                    413,
                    f"request body is over the limit of {max_bytes} bytes (max_body_bytes)",
                    None,
                    "request_too_large",
                )
        return body

    try:
        body = await asyncio.wait_for(receive(), settings.read_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within read_timeout_s={settings.read_timeout_s:g} s",
            None,
            "request_timeout",
        ) from None
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    return decode_json(decoder, bytes(body))


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request was aborted."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes away first, cancel it (which aborts the request in the
    Engine) and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


def check_model(gateway: Gateway, name: str | None) -> None:
    if not gateway.settings.accepts_model(name):
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{gateway.settings.model_id}`",
            "model",
            "model_not_found",
        )


def check_max_tokens(value: int | None, field: str) -> None:
    if value is not None and value < 1:
        raise invalid(f"{field} must be >= 1, got {value}", field)


async def primed(deltas: AsyncIterator[Delta]) -> tuple[Delta, AsyncIterator[Delta]]:
    """The first delta now (so errors surface before any byte is sent), and the rest."""
    try:
        first = await deltas.__anext__()
    except BaseException:
        await deltas.aclose()
        raise
    return first, deltas


async def collect(deltas: AsyncIterator[Delta], n: int) -> list[Delta]:
    """The n samples of a whole completion, each joined, by index; a sample the Engine failed
    (finish reason `error`) makes it a 500."""
    samples = join_samples([delta async for delta in deltas])
    if len(samples) != n or any(s.finish_reason is FinishReason.ERROR for s in samples):
        raise APIError(500, "the engine failed while generating this completion", None, "internal")
    return samples


def usage_of(lasts: list[Delta]) -> Usage:
    """OpenAI's usage of a request: the prompt once, the completion tokens of every choice."""
    return Usage.of(lasts[0].prompt_tokens, sum(d.completion_tokens for d in lasts))


def closing_events(body, lasts: dict[int, Delta], chunk_type, rid: str, created: int, model: str):
    """The end of an SSE stream: the usage chunk (when asked for and every choice finished),
    then `data: [DONE]`."""
    if body.include_usage and len(lasts) == body.n:
        usage = usage_of([lasts[i] for i in range(body.n)])
        yield sse(chunk_type(rid, [], created, model, usage=usage))
    yield SSE_DONE


async def chat_completions(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, ChatCompletionRequest, gateway.settings)
    body.check()
    check_model(gateway, body.model)
    field = body.max_tokens_field
    check_max_tokens(body.requested_max_tokens, field)
    prompt = await gateway.chat_prompt(body.messages, body.add_generation_prompt)
    room = gateway.settings.max_model_len - len(prompt)
    requested = body.requested_max_tokens
    max_tokens = requested if requested is not None else max(room, 1)
    params = body.sampling_params(max_tokens, body.logprobs_count)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    model, created = gateway.settings.model_id, now()
    names = gateway.token_names
    client = gateway.client_of(request.headers, request.client)
    deltas = gateway.generate(
        prompt, params, rid, "messages", body.priority, body.structured_param, client=client
    )
    if not body.stream:
        samples = await until_disconnect(request, collect(deltas, body.n))
        choices = [
            ChatChoice(
                i,
                AssistantMessage(sample.text),
                chat_logprobs(sample.logprobs or [], names) if body.logprobs else None,
                finish_reason(sample.finish_reason),
            )
            for i, sample in enumerate(samples)
        ]
        usage = usage_of(samples)
        if body.prompt_logprobs is None:
            return json_response(ChatCompletion(rid, choices, created, model, usage=usage))
        prompt_lps = prompt_logprobs(samples[0].prompt_logprobs or [], names)
        return json_response(
            ChatCompletionWithPrompt(
                rid, choices, created, model, usage=usage, prompt_logprobs=prompt_lps
            )
        )
    first, rest = await until_disconnect(request, primed(deltas))

    def chunk(index: int, delta: ChunkDelta, reason=None, logprobs=None, usage=None) -> bytes:
        choice = ChatChunkChoice(index, delta, logprobs, reason)
        return sse(ChatCompletionChunk(rid, [choice], created, model, usage=usage))

    def render(delta: Delta) -> list[bytes]:
        events = []
        usage = running_usage(body, delta)
        if delta.text or (body.logprobs and delta.logprobs):
            logprobs = chat_logprobs(delta.logprobs or [], names) if body.logprobs else None
            events.append(chunk(delta.index, ChunkDelta(content=delta.text), None, logprobs, usage))
        if delta.finished:
            reason = finish_reason(delta.finish_reason)
            events.append(chunk(delta.index, ChunkDelta(), reason, usage=usage))
        return events

    opening = [chunk(i, ChunkDelta(role="assistant", content="")) for i in range(body.n)]
    return event_stream(
        body, first, rest, ChatCompletionChunk, rid, created, model, render, opening
    )


def running_usage(body, delta: Delta) -> Usage | None:
    """The usage so far, on every chunk, when stream_options.continuous_usage_stats asks."""
    if body.stream_options is None or not body.stream_options.continuous_usage_stats:
        return None
    return Usage.of(delta.prompt_tokens, delta.completion_tokens)


def event_stream(
    body, first, rest, chunk_type, rid: str, created: int, model: str, render, opening=()
) -> StreamingResponse:
    """A streamed completion as SSE: `opening`, then `render(delta)`'s events for each delta, an
    error event if the engine fails midway, then the usage chunk (when asked) and [DONE]."""

    async def events() -> AsyncIterator[bytes]:
        for event in opening:
            yield event
        lasts: dict[int, Delta] = {}
        try:
            async for delta in chained(first, rest):
                if delta.finished:
                    lasts[delta.index] = delta
                for event in render(delta):
                    yield event
        except APIError as exc:
            yield sse(exc.body())
        finally:
            await rest.aclose()
        for event in closing_events(body, lasts, chunk_type, rid, created, model):
            yield event

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def chained(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """`first`, then the rest (iterated to its end, so the request's metrics get recorded)."""
    yield first
    async for delta in rest:
        yield delta
