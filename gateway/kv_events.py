"""The gateway's subscriptions to each replica's KV events (messages/kv_events.py), feeding that
replica's ReplicaIndex (kv_index.py).

One SUB socket per replica, connected to actors/runtime/addresses.py `kv_events_address` of its
client address, a CURVE client with the keys the gateway uses for that replica's client socket.
Connecting subscribes, and the BlockManager answers each subscription with a snapshot. When the
index falls out of step (a seq gap, bytes that do not decode, the connection dropping: the
BlockManager died, and its cache with it), or no snapshot comes while it is out of step, the
socket is closed and a new one subscribes again: the resync is the snapshot that brings (at
most one re-subscription per RESYNC_GAP_S; the wait for a snapshot doubles up to
MAX_SNAPSHOT_WAIT_S against a replica that publishes nothing).

No bytes end a reader: a message over `max_message_bytes` is dropped by ZMQ (with its
connection), any other that does not decode counts in `undecodable` and is a lost batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from ..actors.runtime.addresses import kv_events_address
from ..messages.codec import DecodeError, Decoder
from ..messages.kv_events import KvEventMessage
from .curve_keys import ClientKeys, secure_dealer
from .kv_index import ReplicaIndex

log = logging.getLogger("gateway.kv_events")
RESYNC_GAP_S = 1.0
FIRST_SNAPSHOT_WAIT_S = 2.0
MAX_SNAPSHOT_WAIT_S = 30.0
RECEIVE_HWM = 1000  # batches queued here before ZMQ drops (a gap, then a resync)


class KvEventFeed:
    def __init__(
        self,
        client_addresses: list[str],
        keys: list[ClientKeys | None],
        indexes: list[ReplicaIndex],
        max_message_bytes: int,
    ):
        """ValueError when a client address has no events address beside it."""
        self.addresses = [kv_events_address(a) for a in client_addresses]
        self.keys = keys
        self.indexes = indexes
        self.max_message_bytes = max_message_bytes
        self.undecodable = [0] * len(indexes)
        self._ctx = zmq.asyncio.Context()
        self._decoder = Decoder(KvEventMessage)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(i)) for i in range(len(self.indexes))]

    def move(self, i: int, client_address: str) -> None:
        """Replica i serves at `client_address` from now on: the next subscription goes to the
        events beside it (the current one ends when its old publisher goes away)."""
        self.addresses[i] = kv_events_address(client_address)

    def _subscribe(self, i: int) -> zmq.asyncio.Socket:
        socket = self._ctx.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        key = self.keys[i]
        if key is not None:
            secure_dealer(socket, **key.options())
        socket.connect(self.addresses[i])
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        return socket

    async def _follow(self, i: int) -> None:
        """Replica i's events into its index, re-subscribing whenever it falls out of step."""
        wait_s, last_subscribed = FIRST_SNAPSHOT_WAIT_S, -RESYNC_GAP_S
        while True:
            await asyncio.sleep(max(0.0, last_subscribed + RESYNC_GAP_S - time.monotonic()))
            last_subscribed = time.monotonic()
            socket = self._subscribe(i)
            try:
                if await self._read(i, socket, wait_s):
                    wait_s = FIRST_SNAPSHOT_WAIT_S
                else:
                    wait_s = min(2 * wait_s, MAX_SNAPSHOT_WAIT_S)
            except zmq.ZMQError as exc:  # the context closing, or a socket broken beyond use
                log.warning("KV events of replica %d: %s", i, exc)
            finally:
                socket.close(linger=0)

    async def _read(self, i: int, socket: zmq.asyncio.Socket, wait_s: float) -> bool:
        """Until the index falls out of step (True: it was in step since this subscription) or
        no message comes within `wait_s` while it is out of step (False). The publisher going
        away (its BlockManager died) is falling out of step: what it held is gone."""
        index = self.indexes[i]
        was_in_step = False
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll(None if index.in_step else wait_s * 1000))
                if not ready:
                    return was_in_step
                if monitor in ready:  # ZMQ does not reconnect after a message over the size
                    await monitor.recv_multipart()
                    if index.in_step:
                        index.lost()
                        return True
                    return was_in_step
                if socket not in ready:
                    continue
                data = await socket.recv()
                try:
                    message = self._decoder.decode(data)
                except DecodeError:
                    self.undecodable[i] += 1
                    if index.in_step:
                        index.lost()
                        return True
                    continue
                if index.apply(message):
                    return True
                was_in_step = was_in_step or index.in_step
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._ctx.term()
