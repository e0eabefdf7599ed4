"""LoopSocket: an event-loop reader over a zmq socket's edge-triggered ZMQ_FD loses no message."""

from __future__ import annotations

import asyncio
import threading

import zmq

from actorserve.actors.runtime.actor import LoopSocket


def _pair(ctx: zmq.Context, kind_in: int, kind_out: int, name: str):
    reader = ctx.socket(kind_in)
    reader.bind(f"inproc://{name}")
    writer = ctx.socket(kind_out)
    writer.connect(f"inproc://{name}")
    return LoopSocket(reader), writer


async def test_a_reader_gets_every_message_in_order_whether_it_waits_or_not():
    ctx = zmq.Context()
    mailbox, writer = _pair(ctx, zmq.PULL, zmq.PUSH, "order")
    try:
        for i in range(5):  # queued before anyone reads
            writer.send(b"early-%d" % i)
        sent = threading.Event()

        def later() -> None:  # from another thread, while the reader sleeps and wakes
            for i in range(300):
                writer.send(b"late-%d" % i)
            sent.set()

        got = [await mailbox.receive() for _ in range(5)]
        thread = threading.Thread(target=later)
        thread.start()
        got += [await asyncio.wait_for(mailbox.receive(), 5) for _ in range(300)]
        thread.join()
        assert got == [b"early-%d" % i for i in range(5)] + [b"late-%d" % i for i in range(300)]
    finally:
        mailbox.close()
        writer.close(0)
        ctx.term()


async def test_a_reply_sent_while_the_reader_sleeps_does_not_hide_a_request_that_came_first():
    """A send on the socket the loop reads processes the socket's pending commands, which can
    clear the edge-triggered ZMQ_FD of a request that arrived in between: the reader must still
    wake for that request."""
    ctx = zmq.Context()
    reader = ctx.socket(zmq.ROUTER)
    reader.bind("inproc://router")
    router = LoopSocket(reader)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"client")
    dealer.connect("inproc://router")
    try:
        dealer.send(b"hello")  # the connection is known to the router from here on
        assert await asyncio.wait_for(router.receive_multipart(), 5) == [b"client", b"hello"]
        waiting = asyncio.create_task(router.receive_multipart())
        await asyncio.sleep(0.01)  # the reader is asleep on the FD now
        dealer.send(b"request")  # arrives; the FD signals ...
        router.send_multipart([b"client", b"reply"])  # ... and this send takes the signal
        assert await asyncio.wait_for(waiting, 5) == [b"client", b"request"]
        assert dealer.recv() == b"reply"
    finally:
        router.close()
        dealer.close(0)
        ctx.term()


class CountingEvent(asyncio.Event):
    sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


async def test_a_message_arriving_after_the_reader_stopped_does_not_keep_the_loop_spinning():
    """The FD stays readable until zmq processes the socket's commands: once the reading task is
    gone (an actor stopping: its teardown may take a step), the loop must not call back on every
    turn."""
    ctx = zmq.Context()
    reader = ctx.socket(zmq.PULL)
    reader.bind("inproc://stopped")
    mailbox = LoopSocket(reader)
    mailbox._readable = wakeups = CountingEvent()
    writer = ctx.socket(zmq.PUSH)
    writer.connect("inproc://stopped")
    try:
        waiting = asyncio.create_task(mailbox.receive())
        await asyncio.sleep(0.01)  # asleep on the FD: the loop watches it from here on
        waiting.cancel()
        writer.send(b"late")  # nobody will read it
        await asyncio.sleep(0.1)  # the loop turns freely meanwhile
        assert wakeups.sets <= 2  # not once a turn
    finally:
        mailbox.close()
        writer.close(0)
        ctx.term()
