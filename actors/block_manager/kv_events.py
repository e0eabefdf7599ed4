"""The BlockManager's KV events (messages/kv_events.py): what its prefix cache gains and loses,
published for the gateways that route on what each replica holds.

`KvEventLog` collects the pool's changes between two publishes (BlockPool calls it where a hash
enters or leaves `cached`, so the events follow that dict exactly). `KvEventPublisher` owns the
XPUB socket at Addresses.kv_events(): after each message that changed the cache the actor
publishes one batch; a subscription arriving (a gateway connecting, reconnecting after this
process restarted, or re-subscribing after it missed a batch) gets a snapshot of every cached
hash. The XPUB is a CURVE server with the client socket's keys and authorized clients where
those are configured. A publisher whose socket cannot be bound logs it and publishes nothing:
the gateways then route without this replica's events, the engine serves on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable

import zmq

from ...messages.codec import encode
from ...messages.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
)
from ..runtime.actor import LoopSocket
from ..runtime.config import EngineConfig
from ..runtime.curve import secure_router

log = logging.getLogger("block_manager.kv_events")
SEND_HWM = 10_000  # batches queued for a slow subscriber; past it ZMQ drops, and it resyncs
SUBSCRIPTION_BYTES = 4096  # a subscription is a byte and a topic (ours empty); CURVE handshakes too
SNAPSHOT_GAP_S = 0.05  # subscriptions arriving this close together get one snapshot


class KvEventLog:
    """The cache's changes since the last `take`, coalesced: consecutive stores of one chain in
    one BlockStored, consecutive removals in one BlocksRemoved."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pending: list[KvEvent] = []

    def stored(self, parent: bytes, block_hash: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockStored([block_hash], parent, self.block_size))

    def removed(self, block_hash: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlocksRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlocksRemoved([block_hash]))

    def take(self) -> list[KvEvent]:
        events, self.pending = self.pending, []
        return events


class KvEventPublisher:
    """Batches numbered per epoch (seq 0: AllCleared), snapshots on subscription."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig, snapshot: Callable[[], Iterable]):
        """`snapshot()`: the hashes the cache holds now."""
        self.block_size = config.block_size
        self.snapshot_of = snapshot
        self.epoch = config.epoch
        self.seq = -1
        self.socket: LoopSocket | None = None
        self._zap = None
        address = config.addresses.kv_events()
        socket = ctx.socket(zmq.XPUB)
        try:
            self._zap = secure_router(socket, config)
            socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, repeats too
            socket.setsockopt(zmq.SNDHWM, SEND_HWM)
            socket.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_BYTES)
            socket.setsockopt(zmq.LINGER, 0)
            if address.startswith("ipc://"):
                os.makedirs(os.path.dirname(address[len("ipc://") :]) or ".", exist_ok=True)
            socket.bind(address)
        except (OSError, ValueError, zmq.ZMQError) as exc:
            log.error("KV events off: cannot publish on %s: %s", address, exc)
            self.close_socket(socket)
            return
        self.socket = LoopSocket(socket)

    def new_epoch(self, epoch: int) -> None:
        """The pool was rebuilt empty: batch 0 of `epoch`, AllCleared."""
        self.epoch, self.seq = epoch, -1
        self.publish([AllCleared()])

    def publish(self, events: list[KvEvent]) -> None:
        if not events or self.socket is None:
            return
        self.seq += 1
        self._send(KvEventBatch(self.epoch, self.seq, time.time(), events))

    def _send(self, message) -> None:
        try:
            self.socket.send_multipart([encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # no subscriber's queue has room: they see the gap and resync

    async def serve_subscriptions(self) -> None:
        """Answer each (re)subscription with a snapshot, never ending on what a peer sends."""
        if self.socket is None:
            return
        while True:
            frame = await self.socket.receive()
            if not frame or frame[0] != 1:
                continue  # an unsubscription, or bytes that are neither
            await asyncio.sleep(SNAPSHOT_GAP_S)  # let the others of a burst arrive
            while self.socket.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.socket.socket.recv(zmq.NOBLOCK)
            hashes = list(self.snapshot_of())
            self._send(KvSnapshot(self.epoch, self.seq, time.time(), self.block_size, hashes))

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        self.close_socket(None)

    def close_socket(self, socket: zmq.Socket | None) -> None:
        if socket is not None:
            socket.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
