"""CurveZMQ key files for engines served on tcp://: `actorserve keys DIR` writes them, the SDK
reads them (and sets them on its socket).

DIR (made 0700) holds, in ZeroMQ's certificate format (what zmq.auth.load_certificate reads):

    server.key                        the engine's public key: every client needs it
    server.key_secret                 the engine's key pair: `serve --curve-server-key`
    client.key                        one client's public key
    client.key_secret                 that client's key pair: the SDK's `client_keys`
    authorized_clients/client.key     the clients the engine admits:
                                      `serve --curve-authorized-clients DIR/authorized_clients`

Every file is created 0600 from the start (os.open with O_EXCL: never a moment readable by
others, never an overwrite of keys in use). More clients: `actorserve keys` in another DIR, then
copy its client.key into the engine's authorized_clients directory (restart to take it).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import msgspec
import zmq

SERVER = "server"
CLIENT = "client"
AUTHORIZED = "authorized_clients"


def _write_certificate(path: Path, public: bytes, secret: bytes | None) -> None:
    """One certificate in czmq's format; 0600, and never over an existing file."""
    kind = "secret" if secret else "public"
    lines = [
        f"#   **** Generated {datetime.datetime.now():%Y-%m-%d %H:%M} by actorserve keys ****",
        f"#   ZeroMQ CURVE {kind} certificate" + ("; keep it private" if secret else ""),
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_keys(directory: str | Path) -> dict[str, Path]:
    """Make the server's and one client's key pairs in `directory`; the paths by role. Raises
    FileExistsError rather than overwrite a key. A new directory is made 0700; an existing one
    keeps its mode (it may be `.`, or a home), the files in it are 0600 all the same."""
    root = Path(directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / AUTHORIZED).mkdir(mode=0o700, exist_ok=True)
    paths = {
        "server_public": root / f"{SERVER}.key",
        "server_secret": root / f"{SERVER}.key_secret",
        "client_public": root / f"{CLIENT}.key",
        "client_secret": root / f"{CLIENT}.key_secret",
        "authorized_client": root / AUTHORIZED / f"{CLIENT}.key",
    }
    taken = next((p for p in paths.values() if p.exists()), None)
    if taken is not None:
        raise FileExistsError(
            f"{taken} exists: actorserve keys never overwrites keys; pick another directory"
        )
    for name in (SERVER, CLIENT):
        public, secret = zmq.curve_keypair()
        _write_certificate(paths[f"{name}_public"], public, None)
        _write_certificate(paths[f"{name}_secret"], public, secret)
        if name == CLIENT:
            _write_certificate(paths["authorized_client"], public, None)
    return paths


def load_server_public_key(path: str | Path) -> bytes:
    """The engine's public key (z85) from server.key (or server.key_secret)."""
    import zmq.auth

    public, _ = zmq.auth.load_certificate(path)
    return public


def load_client_keys(path: str | Path) -> tuple[bytes, bytes]:
    """A client's (public, secret) key pair (z85) from its .key_secret certificate."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(
            f"{path} holds no secret key: pass the client's .key_secret file (from actorserve keys)"
        )
    return public, secret


def client_options(
    server_public_key_path: str | Path | None, client_key_path: str | Path | None
) -> dict:
    """AsyncClient / Client keyword arguments from key files (`{}` when neither is given)."""
    if server_public_key_path is None:
        if client_key_path is not None:
            raise ValueError("a client key needs the server's public key too")
        return {}
    options: dict = {"server_public_key": load_server_public_key(server_public_key_path)}
    if client_key_path is not None:
        options["client_keys"] = load_client_keys(client_key_path)
    return options


class ClientKeys(msgspec.Struct, frozen=True):
    """One SDK connection's CurveZMQ keys, z85 text (what a spec file can carry): the engine's
    public key, and this client's key pair (None: a fresh pair, for an engine that admits any
    client who knows its key)."""

    server_public_key: str
    client_public_key: str | None = None
    client_secret_key: str | None = None

    @classmethod
    def of(
        cls, server_public_key: bytes, client_keys: tuple[bytes, bytes] | None = None
    ) -> ClientKeys:
        public, secret = client_keys or (None, None)
        text = [k.decode() if k is not None else None for k in (server_public_key, public, secret)]
        return cls(*text)

    def options(self) -> dict:
        """AsyncClient / Client keyword arguments."""
        pair = None
        if self.client_public_key is not None and self.client_secret_key is not None:
            pair = (self.client_public_key, self.client_secret_key)
        return {"server_public_key": self.server_public_key, "client_keys": pair}


def secure_dealer(
    socket: zmq.Socket,
    server_public_key: bytes | str | None,
    client_keys: tuple[bytes | str, bytes | str] | None,
) -> None:
    """Make `socket` a CURVE client of the server whose public key is given (before connect).
    Without `client_keys` it uses a fresh key pair: enough for an engine that admits any client
    who knows its key, refused by one with authorized clients."""
    if server_public_key is None:
        if client_keys is not None:
            raise ValueError("client_keys need server_public_key: the engine's CURVE public key")
        return
    public, secret = client_keys or zmq.curve_keypair()
    try:
        socket.curve_serverkey = _key(server_public_key)
        socket.curve_publickey = _key(public)
        socket.curve_secretkey = _key(secret)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        raise ValueError(
            f"invalid CURVE key ({exc}): keys are 40 z85 characters, as actorserve keys writes"
        ) from None


def _key(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else key
