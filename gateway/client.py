"""The ZeroMQ client SDK's `AsyncClient` (asyncio), over one DEALER socket (`Client`, the blocking
one, wraps it: blocking_client.py).

One receive task reads the socket and routes each reply by request id. A stream whose consumer is
slow does not queue without bound: deltas that arrive before it reads are merged into one per
sample (`Delta.index`; a request with n > 1 ends once all n samples have finished).
While streams are open a watchdog pings the Engine every `ping_interval_s` (the Engine also
takes the pings as the client's lease: a client silent for its client_lease_s loses its requests).
Streams the Engine no longer knows (it died and was restarted) are resumed: the request is sent
again with the tokens each sample has received (GenerateRequest.resume), and the Engine goes on
from there, so the stream's output is the one a fault-free run gives; after `max_resumes` of one
stream it fails with EngineError(code="unavailable"). When nothing at all comes back for
`liveness_timeout_s` every stream fails with EngineUnavailable, and at once when the engine
refuses the socket's CurveZMQ handshake (handshake.py). No hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from ..messages.client import (
    AbortRequest,
    Delta,
    DeltaBatch,
    EngineToClient,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Ping,
    Pong,
    ResumedSample,
)
from ..messages.codec import Decoder, encode
from ..messages.common import OutputKind, SamplingParams
from .curve_keys import secure_dealer
from .errors import EngineError, EngineUnavailable
from .handshake import HandshakeWatch
from .request_stream import RequestStream, join_samples


def final_only(params: SamplingParams | None) -> SamplingParams:
    """The params of a whole completion: its output held in the engine until it finishes (see
    SamplingParams.output_kind), not sent after every step."""
    return msgspec.structs.replace(params or SamplingParams(), output_kind=OutputKind.FINAL_ONLY)


class AsyncClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float | None = None,
        ping_interval_s: float = 1.0,
        liveness_timeout_s: float = 10.0,
        max_resumes: int = 3,
        server_public_key: bytes | str | None = None,
        client_keys: tuple[bytes | str, bytes | str] | None = None,
    ):
        """`timeout_s`: longest wait for any message of one stream before EngineUnavailable
        (None: no limit, the watchdog alone decides). `server_public_key` (z85): talk CurveZMQ
        to an engine serving with keys, as `client_keys` (public, secret), or a fresh pair;
        curve_keys.client_options reads both from the files `actorserve keys` wrote."""
        self.address = address
        self.timeout_s = timeout_s
        self.ping_interval_s = ping_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.max_resumes = max_resumes
        self._ping_seq = 0
        self._last_heard = time.monotonic()
        self._watchdog: asyncio.Task | None = None
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        secure_dealer(self._socket, server_public_key, client_keys)
        self._handshake = HandshakeWatch(self._socket, self._refused)
        self._socket.connect(address)
        self._decoder = Decoder(EngineToClient)
        self._streams: dict[str, RequestStream] = {}
        self._health: dict[str, asyncio.Future] = {}
        self._aborts: set[asyncio.Task] = set()  # aborts of streams left early, in flight
        self._receiver: asyncio.Task | None = None

    def _ensure_receiver(self) -> None:
        loop = asyncio.get_running_loop()
        if self._receiver is None or self._receiver.done():
            self._receiver = loop.create_task(self._receive())
        if self._watchdog is None or self._watchdog.done():
            self._last_heard = time.monotonic()
            self._watchdog = loop.create_task(self._watch())
        self._handshake.start()

    def _refused(self, reason: str) -> None:
        """The engine refused (or could not complete) a handshake: every stream and health
        query fails now, naming the address and why, instead of waiting for a timeout."""
        self.fail_all(reason)

    def open_streams(self) -> int:
        return len(self._streams)

    def fail_all(self, reason: str) -> None:
        """Fail every open stream and health query now with EngineUnavailable("the engine at
        ADDRESS <reason>"): the engine is known to be gone (refused us, or moved away)."""
        error = EngineUnavailable(f"the engine at {self.address} {reason}")
        for stream in self._streams.values():
            stream.fail(error)
        for future in self._health.values():
            if not future.done():
                future.set_exception(error)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.ping_interval_s)
            if not self._streams:
                self._last_heard = time.monotonic()
                continue
            if time.monotonic() - self._last_heard > self.liveness_timeout_s:
                error = EngineUnavailable(
                    f"the engine at {self.address} stopped answering "
                    f"({self.liveness_timeout_s:.0f} s without a reply)"
                )
                for stream in self._streams.values():
                    stream.fail(error)
                continue
            self._ping_seq += 1
            try:
                await self._send(encode(Ping(list(self._streams), self._ping_seq)))
            except EngineUnavailable as error:
                for stream in self._streams.values():
                    stream.fail(error)

    async def _receive(self) -> None:
        while True:
            data = await self._socket.recv()
            self._last_heard = time.monotonic()
            try:
                message = self._decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(message, Pong):
                for rid in message.unknown:
                    stream = self._streams.get(rid)
                    if stream is None or stream.finished >= stream.n:
                        continue
                    if message.seq > stream.resumed_at:  # asked after the last resumption
                        await self._resume(rid, stream)
            elif isinstance(message, (Delta, DeltaBatch)):
                for delta in message.deltas if isinstance(message, DeltaBatch) else [message]:
                    stream = self._streams.get(delta.request_id)
                    if stream is not None:
                        stream.push(delta)
            elif isinstance(message, ErrorReply):
                stream = self._streams.get(message.request_id or "")
                if stream is not None:
                    stream.fail(EngineError(message.message, message.code, message.request_id))
                future = self._health.pop(message.request_id or "", None)
                if future is not None and not future.done():
                    future.set_exception(EngineError(message.message, message.code))
            elif isinstance(message, HealthReply):
                future = self._health.pop(message.request_id, None)
                if future is not None and not future.done():
                    future.set_result(message)

    async def _resume(self, rid: str, stream: RequestStream) -> None:
        """Send a stream's request again, as a resumption (the Engine restarted and lost it)."""
        if stream.resumes >= self.max_resumes:
            stream.fail(
                EngineError(
                    f"the engine lost this request {stream.resumes + 1} times (max_resumes="
                    f"{self.max_resumes})",
                    "unavailable",
                    rid,
                )
            )
            return
        stream.resumes += 1
        stream.resumed_at = self._ping_seq
        try:
            await self._send(encode(stream.resumption()))
        except EngineUnavailable as error:
            stream.fail(error)

    async def _send(self, data: bytes) -> None:
        """Send, or raise EngineUnavailable: a DEALER with no connection to queue on (a CURVE
        handshake the Engine refused) would wait for one for ever, so it waits at most
        `liveness_timeout_s`, and no longer than until a handshake fails. After a refused
        handshake it connects again first: the engine may take the keys now, and if not, the
        refusal comes back at once."""
        if self._handshake.refused is not None:
            self._handshake.retry()
            self._socket.disconnect(self.address)
            self._socket.connect(self.address)
        sending = asyncio.ensure_future(self._socket.send(data))
        if not sending.done():  # no connection to queue on: wait for one, or for a refusal
            refused = asyncio.ensure_future(self._handshake.failed.wait())
            await asyncio.wait(
                {sending, refused}, timeout=self.liveness_timeout_s, return_when="FIRST_COMPLETED"
            )
            refused.cancel()
            if not sending.done():
                sending.cancel()
                reason = self._handshake.refused or (
                    f"could not be sent to in {self.liveness_timeout_s} s (no connection: is the "
                    "address right, and are the CurveZMQ keys accepted?)"
                )
                raise EngineUnavailable(f"the engine at {self.address} {reason}")
        sending.result()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        resume: list[ResumedSample] | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream the completion's deltas; the last one has `finish_reason` set.
        `priority`: lower runs first (FCFS within a level). With `params.n` > 1 the deltas of
        the n samples interleave (`Delta.index`) and the stream ends after n finished ones.
        `resume`: go on with a request another engine was streaming (GenerateRequest.resume):
        only the samples listed, from the tokens given; the others had finished.
        `tenant`: the client it is on behalf of, for a program serving several (the gateway):
        the engine's per-client limits and fair share count it as a client of its own.

        Leaving the loop early (break, cancel, error) aborts the request in the engine.
        """
        request = self._request(prompt, params, request_id, priority, False, resume, tenant)
        async with request as stream:
            done = stream.n - stream.unfinished
            while done < stream.n:
                await self._wait(stream)
                deltas, stream.pending = stream.pending, {}
                for index in sorted(deltas):
                    done += deltas[index].finished
                    yield deltas[index]

    @contextlib.asynccontextmanager
    async def _request(
        self, prompt, params, request_id, priority, collect: bool, resume=None, tenant=None
    ):
        """Register the request's stream and send it; on the way out, forget the stream, and
        abort the request in the engine unless every sample finished or it failed there."""
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise EngineError(f"request_id {rid!r} is already streaming", "invalid_request", rid)
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        params = params or SamplingParams()
        request = GenerateRequest(rid, text, ids, params, priority, resume, tenant)
        stream = self._streams[rid] = RequestStream(request, collect)
        self._ensure_receiver()
        try:
            await self._send(encode(request))
            yield stream
        finally:
            self._streams.pop(rid, None)
            if stream.finished < stream.n and stream.error is None:  # else it is gone already
                self._abort_soon(rid)

    async def _wait(self, stream: RequestStream) -> None:
        """Until the stream has news (a collecting one: until it has finished); raises its
        failure, or EngineUnavailable when nothing came for `timeout_s`."""
        while not stream.event.is_set():
            left = None
            if self.timeout_s is not None:
                left = stream.last_push + self.timeout_s - time.monotonic()
                if left <= 0:
                    raise EngineUnavailable(
                        f"no reply from the engine at {self.address} in {self.timeout_s} s"
                    )
            with contextlib.suppress(asyncio.TimeoutError):  # then look at last_push again
                await asyncio.wait_for(stream.event.wait(), left)
        stream.event.clear()
        if stream.error is not None:
            raise stream.error

    def _abort_soon(self, request_id: str) -> None:
        """Abort in a task of its own: a caller cancelled mid-stream (a client disconnect, a
        timeout) cannot cancel the abort with it."""
        task = asyncio.get_running_loop().create_task(self._abort_quietly(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def complete_all(
        self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0
    ) -> list[Delta]:
        """Every sample of the request (`params.n` of them) as one joined Delta, by index."""
        async with self._request(prompt, final_only(params), None, priority, True) as stream:
            await self._wait(stream)
            return join_samples(stream.collected)

    async def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(EngineUnavailable):  # no engine to tell: nothing runs for it
            await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self._send(encode(AbortRequest(request_id)))

    async def health(self, timeout_s: float = 10.0) -> HealthReply:
        rid = uuid.uuid4().hex
        future = self._health[rid] = asyncio.get_running_loop().create_future()
        self._ensure_receiver()
        await self._send(encode(HealthRequest(rid)))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailable(
                f"no health reply from {self.address} in {timeout_s} s"
            ) from None
        finally:
            self._health.pop(rid, None)

    async def close(self) -> None:
        if self._aborts:  # let the aborts go out before the socket closes
            await asyncio.wait(self._aborts, timeout=1.0)
        for task in (self._receiver, self._watchdog):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._socket.disable_monitor()  # before its socket closes, as libzmq asks
        await self._handshake.close()
        self._socket.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
