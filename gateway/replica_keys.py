"""The gateway's CurveZMQ keys for each of its `--replicas`, from its flags, checked before
anything starts.

A replica on another host is named by its address and its server's public key:

    --replicas tcp://10.0.0.2:5555,tcp://10.0.0.3:5555
    --replica-server-keys B/server.key,C/server.key     by position; one file: every replica's
    --curve-client-key A/client.key_secret               the gateway's own key pair

Each replica authorizes the gateway by the public half of that pair (its client.key copied into
the replica's `--curve-authorized-clients` directory). Without `--curve-client-key` the gateway
uses a fresh pair: enough for replicas that admit any client who knows their key. A replica with
no key is reached without CURVE, which is allowed where the engine itself could serve without it
(actors/runtime/curve.py): ipc://, or tcp:// on a loopback host with `--insecure-loopback true`.
"""

from __future__ import annotations

from ..actors.runtime.curve import is_loopback, tcp_host
from .curve_keys import ClientKeys, load_client_keys, load_server_public_key
from .service import GatewaySettings


def replica_keys(settings: GatewaySettings, insecure_loopback: bool) -> list[ClientKeys | None]:
    """Each replica's keys, by position in `settings.replicas`; ValueError naming the flag when
    the key flags do not fit the replicas, a key file cannot be read, or a replica would be
    reached on tcp:// without CURVE where that is not allowed."""
    replicas, paths = settings.replicas, settings.replica_server_keys
    if paths and not replicas:
        raise ValueError("--replica-server-keys needs --replicas: the engines the keys are of")
    if settings.curve_client_key is not None and not paths:
        raise ValueError(
            "--curve-client-key needs --replica-server-keys: the replicas' server.key files "
            "(a client key is of use only to a replica served with CurveZMQ)"
        )
    if len(paths) not in (0, 1, len(replicas)):
        raise ValueError(
            f"--replica-server-keys names {len(paths)} key files for {len(replicas)} "
            "--replicas: give one per replica, in the same order, or one for every replica"
        )
    pair = None
    if settings.curve_client_key is not None:
        try:
            pair = load_client_keys(settings.curve_client_key)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--curve-client-key: {exc}") from None
    keys: list[ClientKeys | None] = []
    for i, address in enumerate(replicas):
        path = paths[i if len(paths) > 1 else 0] if paths else None
        if path is None:
            _check_plain(address, insecure_loopback)
            keys.append(None)
            continue
        try:
            keys.append(ClientKeys.of(load_server_public_key(path), pair))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"--replica-server-keys: cannot read {path} (replica {address}): {exc}"
            ) from None
    return keys


def _check_plain(address: str, insecure_loopback: bool) -> None:
    """Raise ValueError unless `address` may be reached without CURVE."""
    try:
        host = tcp_host(address)
    except ValueError:
        raise ValueError(
            f"--replicas: {address!r} is not a client address (tcp://HOST:PORT or ipc://PATH)"
        ) from None
    if host is None:
        return  # ipc://: the socket file's directory keeps others out
    if not is_loopback(host):
        raise ValueError(
            f"--replicas: refusing to reach {address} without CurveZMQ (anyone on the way could "
            "read and send requests): pass its server.key in --replica-server-keys"
        )
    if not insecure_loopback:
        raise ValueError(
            f"--replicas: {address} is tcp:// without CurveZMQ: pass --insecure-loopback true "
            "(as its engine needs) or its server.key in --replica-server-keys"
        )
