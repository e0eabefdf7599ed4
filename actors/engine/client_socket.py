"""The Engine's client socket: a ROUTER with the limits a hostile client meets, bound where the
config says (CurveZMQ when keys are configured)."""

from __future__ import annotations

import os

import zmq

from ..runtime.config import EngineConfig
from ..runtime.curve import secure_router


def bind_client_router(ctx: zmq.Context, config: EngineConfig):
    """The bound ROUTER and its ZAP authenticator (None without authorized clients: stop it
    before the context terminates). A bind that fails (the port is taken) closes both and
    raises, so the actor exits rather than hang in ctx.term()."""
    router = ctx.socket(zmq.ROUTER)
    zap = secure_router(router, config)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # full or gone: told, not silently dropped
    router.setsockopt(zmq.SNDHWM, config.client_queue_messages)  # then: client_outbox.py
    router.setsockopt(zmq.MAXMSGSIZE, config.max_client_message_bytes)
    address = config.addresses.client
    try:
        if address.startswith("ipc://"):
            os.makedirs(os.path.dirname(address[len("ipc://") :]) or ".", exist_ok=True)
        router.bind(address)
    except (OSError, zmq.ZMQError):
        if zap is not None:
            zap.stop()
        router.close(linger=0)
        raise
    return router, zap
