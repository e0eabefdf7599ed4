"""CurveZMQ on the Engine's client socket, and the rules for exposing it on tcp://.

At start (Supervisor, before any actor): a tcp:// client address needs CURVE keys
(`curve_server_key`), except on a loopback host (127.0.0.0/8, ::1, localhost) when
`insecure_loopback` is set; ipc:// needs nothing (the socket file lives in a 0700 directory).
Without `curve_authorized_clients` any client that knows the server's public key may connect
(CURVE encrypts and proves the server, nothing more); with it only the clients whose public
certificates are in that directory, checked by a ZAP authenticator thread in the Engine process.
`curve_gateway_key` is the public half of a key pair the serving process makes at each start for
its own SDK client (the HTTP gateway, `generate`'s own engine): authorized in memory beside the
directory's, the secret half never written anywhere.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
from pathlib import Path

import msgspec
import zmq

from .config import EngineConfig

log = logging.getLogger("engine.curve")
KEYS_HINT = (
    "run `actorserve keys DIR`, then serve with --curve-server-key DIR/server.key_secret "
    "--curve-authorized-clients DIR/authorized_clients, and give clients DIR/server.key and "
    "DIR/client.key_secret (--curve-server-public-key, --curve-client-key)"
)


def tcp_host(address: str) -> str | None:
    """The host of a tcp://HOST:PORT address (brackets of an IPv6 one removed); None if not tcp."""
    if not address.startswith("tcp://"):
        return None
    match = re.fullmatch(r"tcp://(\[[^\]]*\]|[^:/]*):[^:/]+", address)
    if match is None:
        raise ValueError(f"client address must be tcp://HOST:PORT or ipc://PATH, got {address!r}")
    return match.group(1).strip("[]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name, a host name: may be reachable from outside


def check_curve(config: EngineConfig, address: str | None) -> None:
    """Raise ValueError, naming the flag, when the client address may not be served as asked."""
    if config.curve_authorized_clients is not None and config.curve_server_key is None:
        raise ValueError(
            "curve_authorized_clients (--curve-authorized-clients) needs curve_server_key "
            f"(--curve-server-key) too: {KEYS_HINT}"
        )
    if config.curve_server_key is not None:
        server_keys(config)
        if config.curve_authorized_clients is not None:
            authorized_keys(config.curve_authorized_clients)
        return
    host = tcp_host(address) if address else None
    if host is None:
        return  # ipc://
    if not is_loopback(host):
        raise ValueError(
            f"refusing to serve {address} without CurveZMQ: anyone who can reach it could use "
            f"the engine. To expose it, {KEYS_HINT}"
        )
    if not config.insecure_loopback:
        raise ValueError(
            f"refusing to serve {address} without CurveZMQ: every local user could use the "
            f"engine. Pass --insecure-loopback true to allow it, or {KEYS_HINT}"
        )


def server_keys(config: EngineConfig) -> tuple[bytes, bytes]:
    """(public, secret) from curve_server_key, a secret certificate no one else may read."""
    import zmq.auth

    path = Path(config.curve_server_key)
    try:
        mode = path.stat().st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"curve_server_key (--curve-server-key): cannot read {path}: {exc}"
        ) from None
    if not secret:
        raise ValueError(
            f"curve_server_key (--curve-server-key): {path} holds no secret key; pass the "
            "server.key_secret file that actorserve keys wrote"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"curve_server_key (--curve-server-key): {path} is accessible by others "
            f"(mode {stat.S_IMODE(mode):04o}): chmod 600 {path}"
        )
    return public, secret


def authorized_keys(directory: str) -> set[bytes]:
    """The z85 public keys of the *.key certificates in `directory` (at least one)."""
    import zmq.auth

    if not os.path.isdir(directory):
        raise ValueError(
            f"curve_authorized_clients (--curve-authorized-clients): {directory} is not a "
            "directory of client certificates (*.key)"
        )
    try:
        keys = set(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise ValueError(f"curve_authorized_clients: cannot read {directory}: {exc}") from None
    if not keys:
        raise ValueError(
            f"curve_authorized_clients (--curve-authorized-clients): no *.key certificate in "
            f"{directory}: no client could connect"
        )
    return keys


def with_own_client(config: EngineConfig) -> tuple[EngineConfig, dict]:
    """For a process that serves the engine and talks to it through the SDK itself: the config
    with a fresh key pair's public half authorized, and the SDK options that use it (`{}` when
    the engine has no CURVE)."""
    if config.curve_server_key is None:
        return config, {}
    server_public, _ = server_keys(config)
    public, secret = zmq.curve_keypair()
    config = msgspec.structs.replace(config, curve_gateway_key=public.decode())
    return config, {"server_public_key": server_public, "client_keys": (public, secret)}


class _AllowedClients:
    """The ZAP credentials provider: a fixed set of z85 public keys. A refused key is logged
    once (a client retrying its handshake, or a scan, must not flood the log)."""

    def __init__(self, keys: set[bytes]):
        self.keys = keys
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self.refused and len(self.refused) < 1024:
            self.refused.add(key)
            log.warning("CurveZMQ: refused a client with unauthorized key %s", key.decode())
        return False


def secure_router(socket: zmq.Socket, config: EngineConfig):
    """Make the client ROUTER a CURVE server when `curve_server_key` is set (call before bind).
    Returns the ZAP authenticator (with authorized clients; None otherwise): it must live as long
    as the socket and be stopped before the context terminates (`.stop()`)."""
    if config.curve_server_key is None:
        return None
    public, secret = server_keys(config)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    if config.curve_authorized_clients is None:
        log.info("CurveZMQ server %s: any client with its public key", public.decode())
        return None
    keys = authorized_keys(config.curve_authorized_clients)
    own = {config.curve_gateway_key.encode()} if config.curve_gateway_key else set()
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(socket.context, log=log)
    authenticator.start()
    authenticator.configure_curve_callback("*", _AllowedClients(keys | own))
    log.info(
        "CurveZMQ server %s: %d authorized client(s) from %s",
        public.decode(),
        len(keys),
        config.curve_authorized_clients,
    )
    return authenticator
