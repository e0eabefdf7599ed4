"""The Engine's replies to its clients over the ROUTER: no silent loss, bounded memory.

The ROUTER runs with ROUTER_MANDATORY, so a send to a client whose queue is full raises (EAGAIN)
instead of dropping the message, and a send to a client that went away says so (EHOSTUNREACH).

- A full queue: the client's replies wait here, in order, and go out as its queue drains (a
  retry every `retry_s`). Its deltas wait merged, one per (request, sample), so what waits for a
  reader that does not read is bounded by its requests' output, not by the number of steps;
  its other replies (errors, pongs, health) wait in a list of at most MAX_HELD_REPLIES.
- A client gone: `on_gone(identity)` is called (the Engine aborts that client's requests) and
  whatever waited for it is dropped.
- A client that takes nothing: one whose queue stays full, nothing of what waits going out, for
  `send_timeout_s` is treated as gone. A stream's tokens are of no use to a client that does not
  read them, and its requests would hold their KV blocks and batch seats for as long as they
  run. A slow reader that takes something now and then keeps its requests: what waits for it
  stays bounded by their output.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable

import zmq

from ...messages.client import Delta, DeltaBatch, join
from ...messages.codec import encode
from ..runtime.actor import ErrorThrottle, LoopSocket

MAX_HELD_REPLIES = 1024  # non-delta replies kept for one client whose queue is full

log = logging.getLogger("engine")


class _Held:
    """What waits for one client: at most one encoded message that its queue refused (sent
    first, as it is), then its other replies and its deltas by (request id, sample), joined
    into one message only when there is room for it."""

    def __init__(self):
        self.took_at = time.monotonic()  # when the client last took a message (or was refused)
        self.refused: bytes | None = None
        self.deltas: dict[tuple[str, int], list[Delta]] = {}
        self.replies: list = []

    def add_delta(self, delta: Delta) -> None:
        self.deltas.setdefault((delta.request_id, delta.index), []).append(delta)

    def next_message(self) -> bytes | None:
        """The next message to send (taken out of what waits), None when nothing waits."""
        if self.refused is not None:
            message, self.refused = self.refused, None
            return message
        if self.replies:
            return encode(self.replies.pop(0))
        if self.deltas:
            deltas = [join(parts) for parts in self.deltas.values()]
            self.deltas = {}
            return encode(deltas[0] if len(deltas) == 1 else DeltaBatch(deltas))
        return None


class ClientOutbox:
    def __init__(
        self,
        router: LoopSocket,
        on_gone: Callable[[bytes], None],
        send_timeout_s: float,
        retry_s: float = 0.005,
        max_retry_s: float = 0.2,
    ):
        self.router = router
        self.on_gone = on_gone
        self.send_timeout_s = send_timeout_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.held: dict[bytes, _Held] = {}
        self._delay = retry_s  # doubles while no client takes anything, back to retry_s after
        self._retry: asyncio.TimerHandle | None = None
        self._dropped = ErrorThrottle()

    def send(self, identity: bytes, message) -> None:
        """Any reply but deltas (those go through `send_deltas`)."""
        held = self.held.get(identity)
        if held is None:
            data = encode(message)
            if self._try(identity, data):
                return
            self._hold(identity).refused = data
            return
        if len(held.replies) < MAX_HELD_REPLIES:
            held.replies.append(message)
        elif self._dropped.take() is not None:
            log.warning("a client that does not read: dropped a %s", type(message).__name__)

    def send_deltas(self, identity: bytes, deltas: list[Delta]) -> None:
        """One client's deltas of one step, as one message (a DeltaBatch when several)."""
        held = self.held.get(identity)
        if held is None:
            data = encode(deltas[0] if len(deltas) == 1 else DeltaBatch(deltas))
            if self._try(identity, data):
                return
            self._hold(identity).refused = data
            return
        for delta in deltas:
            held.add_delta(delta)

    def forget(self, identity: bytes) -> None:
        self.held.pop(identity, None)

    def _try(self, identity: bytes, data: bytes) -> bool:
        """Send now: True when sent or the client is gone (then reported), False when full."""
        try:
            self.router.send_multipart([identity, data], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.forget(identity)
            self.on_gone(identity)
            return True

    def _hold(self, identity: bytes) -> _Held:
        held = self.held[identity] = _Held()
        self._schedule()
        return held

    def _schedule(self) -> None:
        if self._retry is None and self.held:
            self._retry = asyncio.get_running_loop().call_later(self._delay, self._flush)

    def _flush(self) -> None:
        """Send what waits, in order, as far as each client's queue takes it; a client that
        has taken nothing for send_timeout_s is gone."""
        self._retry = None
        progress = False
        now = time.monotonic()
        for identity, held in list(self.held.items()):
            while (data := held.next_message()) is not None:
                if not self._try(identity, data):
                    held.refused = data
                    if now - held.took_at >= self.send_timeout_s:
                        self._stalled(identity)
                    break
                progress = True
                held.took_at = now
                if identity not in self.held:
                    break  # it went away
            else:
                if self.held.get(identity) is held:
                    del self.held[identity]
        self._delay = self.retry_s if progress else min(2 * self._delay, self.max_retry_s)
        self._schedule()

    def _stalled(self, identity: bytes) -> None:
        log.warning(
            "client %s took none of its replies for %g s (send_timeout_s): aborting its requests",
            identity.hex(),
            self.send_timeout_s,
        )
        self.forget(identity)
        self.on_gone(identity)
