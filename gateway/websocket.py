"""WebSocket /v1/stream: many requests at once on one socket, each with the client's own id.

Client -> server (JSON text frames):
    {"type": "generate", "id": "a", "prompt": "..." | "prompt_token_ids": [..] | "messages": [..],
     "params": {"max_tokens": 64, "temperature": 0, ...}}       (params: SamplingParams fields)
    {"type": "abort", "id": "a"}
Server -> client:
    {"type": "delta", "id": "a", "text": "...", "token_ids": [..]}
    {"type": "done", "id": "a", "finish_reason": "stop|length|abort|error",
     "usage": {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C}}
    {"type": "error", "id": "a" | null, "status": 400, "message": "...", "param": "..." | null}
With params.n > 1 every delta and done frame also carries "index" (the sample), and the request
ends after n done frames. With params.logprobs a delta carries "logprobs": one
[token_id, logprob, rank, [[id, logprob], ...]] per token id (the top list left out when
params.logprobs is 0); with params.prompt_logprobs the first delta carries "prompt_logprobs"
(null for the first prompt token, then such entries).
Closing the socket aborts every request still running on it. With an API key, the socket needs
`Authorization: Bearer KEY` or (from a browser) the subprotocols ["actorserve", "bearer.KEY"].

Limits: a message over max_body_bytes closes the socket (1009, uvicorn's ws_max_size); a
generate beyond max_requests_per_socket live ones on this socket gets an error frame (429) and
the socket goes on; a handshake while max_connections are open is refused (503). A client that
stops reading: deltas merge in the SDK while a send waits, and a connection that takes nothing
for send_timeout_s is dropped (connections.py), which ends every request on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import msgspec
from fastapi import WebSocket, WebSocketDisconnect

from ..messages.client import Delta
from ..messages.common import SamplingParams
from .api_keys import matching_key, offered_keys
from .guards import refuse
from .openai_errors import APIError, decode_json, invalid
from .openai_requests import ChatMessage
from .service import RETRY_AFTER, Gateway

log = logging.getLogger("gateway")
SUBPROTOCOL = "actorserve"
MAX_ID_CHARS = 200


class Generate(msgspec.Struct, tag="generate", tag_field="type", forbid_unknown_fields=True):
    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)


class Abort(msgspec.Struct, tag="abort", tag_field="type", forbid_unknown_fields=True):
    id: str


_decoder = msgspec.json.Decoder(Generate | Abort)
_encoder = msgspec.json.Encoder()


def offered(websocket: WebSocket) -> list[str]:
    """The API keys the handshake presents (header or `bearer.KEY` subprotocol)."""
    return offered_keys(websocket.headers, websocket.scope.get("subprotocols", []))


def authorized(websocket: WebSocket, api_keys: list[str]) -> bool:
    return not api_keys or matching_key(api_keys, offered(websocket)) is not None


class StreamSocket:
    """One connected socket: its live requests by client id, and one lock around sends."""

    def __init__(self, websocket: WebSocket, gateway: Gateway):
        self.ws = websocket
        self.gateway = gateway
        self.prefix = f"ws-{uuid.uuid4().hex[:12]}-"
        subprotocols = websocket.scope.get("subprotocols", [])
        self.client = gateway.client_of(websocket.headers, websocket.client, subprotocols)
        self.live: dict[str, asyncio.Task] = {}
        self._send_lock = asyncio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:  # backpressure: deltas merge in the SDK while we wait here
            await self.ws.send_text(_encoder.encode(message).decode())

    async def send_error(self, rid: str | None, error: APIError) -> None:
        self.gateway.metrics.error(error.status)
        await self.send(
            {
                "type": "error",
                "id": rid,
                "status": error.status,
                "message": error.message,
                "param": error.param,
            }
        )

    async def serve(self) -> None:
        try:
            while True:
                frame = await self.ws.receive()
                if frame["type"] == "websocket.disconnect":
                    return
                data = frame.get("text") or frame.get("bytes") or b""
                await self.on_message(data)
        except WebSocketDisconnect:
            return
        finally:
            for task in self.live.values():
                task.cancel()  # each aborts its request in the Engine on the way out
            if self.live:
                await asyncio.gather(*self.live.values(), return_exceptions=True)

    async def on_message(self, data: str | bytes) -> None:
        try:
            message = decode_json(_decoder, data, "message")
        except APIError as exc:
            await self.send_error(_peek_id(data), exc)
            return
        if isinstance(message, Abort):
            if message.id in self.live:
                await self.gateway.client.abort(self.prefix + message.id)
            else:
                await self.send_error(
                    message.id,
                    APIError(404, f"no live request with id {message.id!r} on this socket", "id"),
                )
            return
        try:
            param = self.check(message)
        except APIError as exc:
            await self.send_error(message.id, exc)
            return
        self.live[message.id] = asyncio.create_task(self.run(message, param))

    def check(self, message: Generate) -> str:
        """Refuse what this socket cannot take; the name of the prompt's field."""
        if not message.id or len(message.id) > MAX_ID_CHARS:
            raise invalid(f"id must be 1 to {MAX_ID_CHARS} characters", "id")
        if message.id in self.live:
            raise invalid(f"id {message.id!r} is already running on this socket", "id")
        limit = self.gateway.settings.max_requests_per_socket
        if len(self.live) >= limit:
            raise APIError(
                429,
                f"this socket has {len(self.live)} live requests, the most one socket may have "
                f"(max_requests_per_socket={limit}); wait for one to finish or open another",
                None,
                "rate_limit_exceeded",
                RETRY_AFTER,
            )
        given = [
            name
            for name in ("prompt", "prompt_token_ids", "messages")
            if getattr(message, name) is not None
        ]
        if len(given) != 1:
            raise invalid(
                "give exactly one of prompt, prompt_token_ids and messages",
                given[1] if len(given) > 1 else "prompt",
            )
        return given[0]

    async def prompt(self, message: Generate) -> str | list[int]:
        if message.messages is not None:  # rendered in a thread, in this request's own task
            return await self.gateway.chat_prompt(message.messages)
        return message.prompt if message.prompt is not None else message.prompt_token_ids

    async def run(self, message: Generate, param: str) -> None:
        rid = message.id
        try:
            prompt = await self.prompt(message)
            # closed here, not when garbage collected: leaving early aborts the request now
            deltas = self.gateway.generate(
                prompt, message.params, self.prefix + rid, param, client=self.client
            )
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    for frame in frames_of(rid, delta, message.params.n > 1):
                        await self.send(frame)
        except APIError as exc:
            await self.send_error(rid, exc)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the socket went away mid-send: `serve` cancels the rest
        finally:
            self.live.pop(rid, None)


def frames_of(rid: str, delta: Delta, several: bool) -> list[dict[str, Any]]:
    """What one delta sends: a delta frame if it carries anything, then a done frame if its
    sample finished (both with the sample's index when the request has several)."""
    sample = {"index": delta.index} if several else {}
    frames: list[dict[str, Any]] = []
    if delta.text or delta.token_ids or delta.prompt_logprobs is not None:
        frame = {"type": "delta", "id": rid, **sample, "text": delta.text}
        frame["token_ids"] = delta.token_ids
        if delta.logprobs is not None:
            frame["logprobs"] = delta.logprobs
        if delta.prompt_logprobs is not None:
            frame["prompt_logprobs"] = delta.prompt_logprobs
        frames.append(frame)
    if delta.finished:
        p, c = delta.prompt_tokens, delta.completion_tokens
        usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        frame = {"type": "done", "id": rid, **sample, "finish_reason": delta.finish_reason.value}
        frame["usage"] = usage
        frames.append(frame)
    return frames


def _peek_id(data: str | bytes) -> str | None:
    """The `id` of a message that did not decode, to name it in the error (if it is a fit id:
    the error frame should not echo a megabyte back)."""
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else None


async def stream_endpoint(websocket: WebSocket, gateway: Gateway) -> None:
    if not authorized(websocket, gateway.settings.api_key):
        await websocket.close(code=1008, reason="missing or wrong API key")
        return
    # uvicorn applies its connection limit to HTTP requests only: sockets are counted here,
    # this one included (it is in the set from its first byte)
    limit = gateway.settings.max_connections
    if len(gateway.connections) > limit:
        error = APIError(
            503,
            f"the server has {len(gateway.connections) - 1} open connections, its limit "
            f"(max_connections={limit}); retry shortly",
            None,
            "unavailable",
            RETRY_AFTER,
        )
        await refuse(websocket.scope, websocket.receive, websocket.send, error)
        return
    offered = websocket.scope.get("subprotocols", [])
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    await StreamSocket(websocket, gateway).serve()
