"""The gateway's connections under uvicorn: their limits, and what uvicorn leaves open.

From uvicorn's own options (`server_config`): `limit_concurrency` (max_connections; a request
over it gets uvicorn's plain 503, and WebSocket handshakes, which uvicorn does not count, are
counted in websocket.py), `timeout_keep_alive` (keep_alive_s), h11's
`max_incomplete_event_size` (max_header_bytes) and `ws_max_size` (max_body_bytes: a WebSocket
message is held whole, like a body).

Three holes, closed by the protocol subclasses here (uvicorn's h11 and websockets sans-I/O ones):

1. uvicorn arms no timer before a connection's first request, and its keep-alive timer stops
   at the first byte of the next one: a client that connects and sends nothing, or its head a
   byte at a time, held a connection forever. Here a request's head must be complete within
   read_timeout_s of the connection starting to wait for it (opened, or the previous response
   sent); else a 408 (nothing at all sent: just closed). The body's deadline is read_body's.
2. A client that stops reading fills the kernel's buffers, the transport pauses writing, and
   every send on it waits: a response or a WebSocket stream, with it the request in the Engine
   and its admission slot, and uvicorn's close() waits for the buffer to drain as well. Before
   that, the kernel's send buffer may take megabytes: a stream nobody reads runs on to its end.
   Here a connection whose peer has taken none of our output for send_timeout_s is aborted:
   output waits and the peer's acknowledged bytes have not moved (send_progress.py: where the
   kernel does not say, its writing has stayed paused). connection_lost wakes each waiting
   send as a disconnect, and the routes abort their requests on the way out. A WebSocket peer
   that answers no keep-alive ping is aborted the same way.
3. h11's max_incomplete_event_size bounds a head only while it is incomplete: one that comes
   whole in one read passed at any size. Here a head over max_header_bytes, however it came,
   gets a 431 naming the limit; a malformed one a 400 (uvicorn: plain text), both in OpenAI's
   JSON error shape like every other refusal.
"""

from __future__ import annotations

import asyncio
import logging

import h11
import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from .openai_errors import APIError
from .send_progress import peer_progress
from .service import GatewaySettings

log = logging.getLogger("gateway")


class GatewayConfig(uvicorn.Config):
    """uvicorn's config with the gateway's limits; `settings` is where the protocols read theirs."""

    def __init__(self, app, settings: GatewaySettings, **options):
        super().__init__(
            app,
            http=HTTPProtocol,
            ws=WebSocketProtocol,
            # uvicorn counts the connection asking among the open ones: +1 lets N be open
            limit_concurrency=settings.max_connections + 1,
            timeout_keep_alive=settings.keep_alive_s,
            h11_max_incomplete_event_size=settings.max_header_bytes,
            ws_max_size=settings.max_body_bytes,
            **options,
        )
        self.settings = settings


class _AbortStuckWrites:
    """Hole 2 above, for either protocol: both get pause_writing / resume_writing from the
    transport and have `config`, `loop`, `transport` and `client`. The peer's progress is
    looked at every quarter of send_timeout_s (at most every second)."""

    _stuck: asyncio.TimerHandle | None = None
    _watch: asyncio.TimerHandle | None = None
    _acked = -1
    _progress_at = 0.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._progress_at = self.loop.time()
        self._watch_peer()

    def _watch_peer(self) -> None:
        self._watch = None
        if self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        progress = peer_progress(sock) if sock is not None else None
        if progress is None:
            return  # the kernel does not say: the paused writing's timer alone
        acked, unacknowledged = progress
        now = self.loop.time()
        waiting = unacknowledged > 0 or self.transport.get_write_buffer_size() > 0
        timeout = self.config.settings.send_timeout_s
        if acked != self._acked or not waiting:
            self._acked, self._progress_at = acked, now
        elif now - self._progress_at >= timeout:
            self._abort_stuck()
            return
        self._watch = self.loop.call_later(min(timeout / 4, 1.0), self._watch_peer)

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stuck is None:
            timeout = self.config.settings.send_timeout_s
            self._stuck = self.loop.call_later(timeout, self._abort_stuck)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_stuck()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_stuck()
        self._stop_watching()
        super().connection_lost(exc)

    def _cancel_stuck(self) -> None:
        if self._stuck is not None:
            self._stuck.cancel()
            self._stuck = None

    def _abort_stuck(self) -> None:
        self._cancel_stuck()
        self._stop_watching()
        log.warning(
            "dropping the connection of %s: it took none of our output for %g s (send_timeout_s)",
            self.client,
            self.config.settings.send_timeout_s,
        )
        self.transport.abort()


def answer_and_close(transport, status: int, message: str, code: str) -> None:
    """Write an OpenAI-shaped error response and close: for a head that never made a request
    (so h11 has no request to answer, and uvicorn's app never sees it)."""
    body = msgspec.json.encode(APIError(status, message, None, code).body())
    transport.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, STATUS_PHRASES[status], len(body), body)
    )
    transport.close()


class HTTPProtocol(_AbortStuckWrites, H11Protocol):
    """uvicorn's h11 protocol with holes 1 to 3 closed."""

    _head_deadline: asyncio.TimerHandle | None = None
    _waiting_after = None  # the request cycle before the head we wait for (None: the first)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # answered and closing: what else comes is not read
        if self.conn.their_state is h11.IDLE and self._head_too_long(data):
            limit = self.config.settings.max_header_bytes
            message = f"the request line and headers are over max_header_bytes={limit} bytes"
            answer_and_close(self.transport, 431, message, "request_header_fields_too_large")
            return
        super().data_received(data)
        self._check_head()

    def _head_too_long(self, data: bytes) -> bool:
        """h11's limit holds only while a head is incomplete: one that arrives whole in one
        read passes at any size. The head is all up to its blank line, however it came."""
        pending = self.conn.trailing_data[0] + data
        end = pending.find(b"\r\n\r\n")
        return (len(pending) if end < 0 else end + 4) > self.config.settings.max_header_bytes

    def on_response_complete(self) -> None:
        self._await_head()  # before: uvicorn may go straight on to a pipelined request
        super().on_response_complete()
        self._check_head()

    def handle_websocket_upgrade(self, event) -> None:
        self._cancel_head_deadline()  # the WebSocket protocol takes the connection over
        self._stop_watching()  # it watches the peer from now on
        self._cancel_stuck()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._cancel_head_deadline()
        self._waiting_after = self.cycle
        timeout = self.config.settings.read_timeout_s
        self._head_deadline = self.loop.call_later(timeout, self._head_timeout)

    def _check_head(self) -> None:
        """uvicorn makes a new request cycle for each head it has parsed."""
        if self._head_deadline is not None and self.cycle is not self._waiting_after:
            self._cancel_head_deadline()

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timeout(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.cycle is not self._waiting_after:
            return
        if not self.conn.trailing_data[0]:  # not a byte of a next request: just close
            self.transport.close()
            return
        timeout = self.config.settings.read_timeout_s
        message = f"the request head did not arrive within read_timeout_s={timeout:g} s"
        answer_and_close(self.transport, 408, message, "request_timeout")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 refused, in the JSON shape of every other refusal."""
        message = "not a valid HTTP/1.1 request: its line or headers do not parse"
        answer_and_close(self.transport, 400, message, "invalid_request")


class WebSocketProtocol(_AbortStuckWrites, WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (websockets' sans-I/O) with hole 2 closed."""

    def keepalive_timeout(self) -> None:
        closing = self.close_sent or self.transport.is_closing()
        super().keepalive_timeout()  # sends a close and closes, which waits for the buffer
        if not closing:
            self.transport.abort()
