"""Clients cannot touch each other's requests, and a client that does not read loses nothing:
request ids are per client, Abort and Ping act on the sender's own requests, a reader that
stalls gets every token once it reads again (merged while it did not), and a client that goes
away has its requests aborted."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from actorserve.messages.client import (
    AbortRequest,
    Delta,
    DeltaBatch,
    EngineToClient,
    GenerateRequest,
    Ping,
    Pong,
)
from actorserve.messages.codec import Decoder, encode
from actorserve.messages.common import SamplingParams
from support import EngineServer, hf_greedy, prompts_of_lengths

LONG = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir):
    # A tiny per-client queue, so a reader that stalls makes the Engine hold its replies.
    server = EngineServer(llama_dir, "--client-queue-messages", "2", "--client-lease-s", "3")
    yield server
    assert server.stop() == 0


class RawClient:
    """A DEALER that reads only when asked."""

    def __init__(self, address: str, rcvhwm: int = 1000):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self.socket.setsockopt(zmq.RCVBUF, 4096)  # small kernel buffers: the queue fills
        self.socket.connect(address)
        self.decoder = Decoder(EngineToClient)

    def send(self, message) -> None:
        self.socket.send(encode(message))

    def deltas_until_done(self, request_ids: set[str], timeout_s: float = 60) -> dict:
        """Every delta of these requests, joined by id, until each has finished. It pings once a
        second while it reads, as the SDK does: a client that only reads is silent, and the
        Engine aborts a silent client's requests after client_lease_s."""
        got: dict[str, list[Delta]] = {rid: [] for rid in request_ids}
        deadline = time.monotonic() + timeout_s
        pinged = time.monotonic()
        while any(not d or not d[-1].finished for d in got.values()):
            assert time.monotonic() < deadline, "timed out"
            if time.monotonic() - pinged >= 1.0:
                self.send(Ping(sorted(request_ids)))
                pinged = time.monotonic()
            if not self.socket.poll(200):
                continue
            message = self.decoder.decode(self.socket.recv())
            if isinstance(message, Pong):
                continue
            for delta in message.deltas if isinstance(message, DeltaBatch) else [message]:
                got[delta.request_id].append(delta)
        return got

    def pong(self, request_ids: list[str]) -> Pong:
        """The Pong to a Ping of these ids (seq 1: the reading loop's keep-alive pings are 0)."""
        self.send(Ping(request_ids, seq=1))
        while True:
            assert self.socket.poll(10_000)
            message = self.decoder.decode(self.socket.recv())
            if isinstance(message, Pong) and message.seq == 1:
                return message

    def close(self) -> None:
        self.socket.close()
        self.ctx.term()


def test_two_clients_may_use_the_same_request_id_and_cannot_abort_each_other(llama_dir, engine):
    a, b = RawClient(engine.address), RawClient(engine.address)
    try:
        prompt = prompts_of_lengths(llama_dir, [30])[0]
        for client in (a, b):
            client.send(GenerateRequest("same", prompt_token_ids=prompt, params=LONG))
        b.send(AbortRequest("same"))  # b's own request: only that one ends
        assert a.pong(["same"]).unknown == []
        got_a = a.deltas_until_done({"same"})["same"]
        got_b = b.deltas_until_done({"same"})["same"]
        assert [t for d in got_a for t in d.token_ids] == hf_greedy(llama_dir, prompt, 150)
        assert got_a[-1].finish_reason.value == "length"
        assert got_b[-1].finish_reason.value == "abort"
        assert b.pong(["same"]).unknown == ["same"]  # b does not see a's live request
    finally:
        a.close()
        b.close()


def test_a_reader_that_stalls_gets_every_token_without_a_gap(llama_dir, engine):
    prompts = prompts_of_lengths(llama_dir, [10, 20, 30, 40, 50, 60, 70, 80])
    with_logprobs = msgspec.structs.replace(LONG, logprobs=20)  # big deltas: the queue fills
    client = RawClient(engine.address, rcvhwm=2)
    try:
        ids = {f"r{i}" for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            client.send(GenerateRequest(f"r{i}", prompt_token_ids=prompt, params=with_logprobs))
        for _ in range(6):  # read nothing for 3 s, but ping: the lease holds
            time.sleep(0.5)
            client.send(Ping(sorted(ids)))
        got = client.deltas_until_done(ids)
        for i, prompt in enumerate(prompts):
            deltas = got[f"r{i}"]
            tokens = [t for d in deltas for t in d.token_ids]
            assert tokens == hf_greedy(llama_dir, prompt, 150), f"request r{i}"
            assert sum(len(d.logprobs or ()) for d in deltas) == 150
        held_somewhere = sum(len(d) for d in got.values()) < 8 * 150
        assert held_somewhere  # the stalled reader got merged deltas, not one per token
    finally:
        client.close()


def test_a_client_that_goes_silent_has_its_requests_aborted(llama_dir, engine):
    client = RawClient(engine.address)
    prompt = prompts_of_lengths(llama_dir, [15])[0]
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True, n=64)
    client.send(GenerateRequest("silent", prompt_token_ids=prompt, params=params))
    sent = time.monotonic()
    time.sleep(0.5)
    assert engine.client.health().stats.num_running == 64
    # It neither reads nor pings: past client_lease_s (3 s here) its request is aborted,
    # before its 64 x 2000 tokens are done.
    while engine.client.health().stats.num_running and time.monotonic() < sent + 30:
        time.sleep(0.2)
    assert engine.client.health().stats.num_running == 0
    ends = {}
    while len(ends) < 64:
        assert client.socket.poll(10_000), "the aborted request's last deltas did not come"
        message = client.decoder.decode(client.socket.recv())
        for delta in message.deltas if isinstance(message, DeltaBatch) else [message]:
            if delta.finished:
                ends[delta.index] = (delta.finish_reason.value, delta.completion_tokens)
    assert all(reason == "abort" and count < 2000 for reason, count in ends.values())
    client.close()
