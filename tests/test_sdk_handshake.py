"""The SDK against a CurveZMQ server that refuses it (a bare ROUTER with an authenticator, no
engine): its requests fail at once, naming the address and why, instead of waiting out the
liveness timeout; and a client the server admits is answered."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import zmq
from zmq.auth.thread import ThreadAuthenticator

from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineUnavailable
from actorserve.messages.client import HealthReply, HealthRequest
from actorserve.messages.codec import Decoder, encode

LIVENESS_S = 30.0  # what a refused client would otherwise wait


class Admitted:
    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


@pytest.fixture
def server():
    """A CURVE ROUTER on tcp://127.0.0.1 admitting one client key, answering HealthRequests."""
    ctx = zmq.Context()
    server_public, server_secret = zmq.curve_keypair()
    client_pair = zmq.curve_keypair()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", Admitted(client_pair[0]))
    router = ctx.socket(zmq.ROUTER)
    router.curve_secretkey, router.curve_publickey = server_secret, server_public
    router.curve_server = True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    router.bind(address)
    yield address, router, server_public, client_pair
    router.close(linger=0)
    auth.stop()
    ctx.term()


async def health(address: str, router: zmq.Socket, **options) -> HealthReply:
    """The client's health query, answered by hand if it reaches the router."""
    async with AsyncClient(address, liveness_timeout_s=LIVENESS_S, **options) as client:
        query = asyncio.ensure_future(client.health(timeout_s=LIVENESS_S))
        deadline = time.monotonic() + 5
        while not query.done() and time.monotonic() < deadline:
            if router.poll(10):
                identity, data = router.recv_multipart()
                request = Decoder(HealthRequest).decode(data)
                router.send_multipart([identity, encode(HealthReply(request.request_id, True))])
            await asyncio.sleep(0.01)
        return await query


def test_an_admitted_client_is_answered(server):
    address, router, server_public, client_pair = server
    reply = asyncio.run(
        health(address, router, server_public_key=server_public, client_keys=client_pair)
    )
    assert reply.ok


@pytest.mark.parametrize(
    "who, reason",
    [
        ("unauthorized key", "refused this client's CurveZMQ key"),
        ("another server's key", "failed the CurveZMQ handshake"),
    ],
)
def test_a_refused_client_fails_at_once_naming_the_address_and_why(server, who, reason):
    address, router, server_public, client_pair = server
    if who == "unauthorized key":
        options = {"server_public_key": server_public, "client_keys": zmq.curve_keypair()}
    else:
        options = {"server_public_key": zmq.curve_keypair()[0], "client_keys": client_pair}
    started = time.monotonic()
    with pytest.raises(EngineUnavailable) as failure:
        asyncio.run(health(address, router, **options))
    assert time.monotonic() - started < 5  # not LIVENESS_S
    assert str(failure.value).startswith(f"the engine at {address} {reason}")
