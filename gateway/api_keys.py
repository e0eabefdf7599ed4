"""The gateway's API keys (`api_key`: one or several) and which one a request presents.

A request presents a key as `Authorization: Bearer KEY`, or (a WebSocket handshake, which a
browser cannot give headers) as a `bearer.KEY` subprotocol. Keys are compared in constant time.
Each key is a client of its own to the per-client limits (client_limits.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.datastructures import Headers


def offered_keys(headers: Headers, subprotocols: Iterable[str] = ()) -> list[str]:
    """The keys a request presents: its bearer token, and its `bearer.KEY` subprotocols."""
    offered = []
    authorization = headers.get("authorization", "")
    if authorization.startswith("Bearer "):
        offered.append(authorization.removeprefix("Bearer ").strip())
    offered += [p.removeprefix("bearer.") for p in subprotocols if p.startswith("bearer.")]
    return [key for key in offered if key]


def matching_key(keys: list[str], offered: list[str]) -> str | None:
    """The key of `keys` one of `offered` is (None: none is)."""
    given = [o.encode("latin-1", "replace") for o in offered]
    for key in keys:
        if any([hmac.compare_digest(o, key.encode()) for o in given]):  # each compared
            return key
    return None
