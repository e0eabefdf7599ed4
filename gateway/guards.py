"""Who may talk to the gateway: the Host it is called by, the browser Origin, the API key.

Outermost first, on every HTTP request and WebSocket handshake:

    Host     with `allowed_hosts` set, a Host header not in it is a 400 (off by default). A
             server on a private address should set it: DNS rebinding gives a hostile page
             the same origin as the gateway under the attacker's host name.
    Origin   a browser's Origin must be the page's own (its host:port equal to the Host
             header) or one of `allowed_origins` (`*`: any); else 403. Clients that are not
             browsers send no Origin and pass.
    CORS     with `allowed_origins` set, Starlette's CORSMiddleware answers preflights and
             adds Access-Control-Allow-Origin for them (same-origin pages need neither).
    API key  with a key set, every HTTP route but the page, /health and /ready needs
             `Authorization: Bearer KEY` (401); the WebSocket checks it in its handler.

A POST of the JSON routes must also say `Content-Type: application/json` (415, read_body):
that keeps a cross-origin page from sending one as a "simple" request without a preflight.
Refusals are OpenAI's JSON error shape, a WebSocket's as its handshake's HTTP response.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from .api_keys import matching_key, offered_keys
from .openai_errors import APIError
from .openai_routes import error_response
from .service import GatewaySettings

OPEN_PATHS = ("/", "/health", "/ready")  # the static page and the load balancer's checks


def has_api_key(headers: Headers, api_keys: list[str]) -> bool:
    """Whether the request carries `Authorization: Bearer KEY`, KEY one of `api_keys` (always,
    without a key set)."""
    return not api_keys or matching_key(api_keys, offered_keys(headers)) is not None


async def refuse(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    """Answer with `error`; a WebSocket handshake gets it as its HTTP response where the server
    can send one, else the plain 403 of a close before accept."""
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get(
        "extensions", {}
    ):
        await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
        return
    await error_response(error)(scope, receive, send)


def host_allowed(host: str, allowed: list[str]) -> bool:
    """`host` (a Host header, port and all) against names like `example.com`, `*.example.com`
    (any subdomain) and `*` (any)."""
    name = host.strip().lower()
    if name.startswith("["):  # [v6 address]:port
        name = name[: name.find("]") + 1]
    else:
        name = name.rsplit(":", 1)[0]
    for pattern in allowed:
        pattern = pattern.strip().lower()
        if pattern == "*" or pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def origin_allowed(origin: str, host: str, allowed: list[str]) -> bool:
    """The page's own origin (scheme://host:port with the Host header's host:port), one of
    `allowed` (compared without a trailing slash, case aside), or any with `*`."""
    if "*" in allowed:
        return True
    normal = origin.strip().rstrip("/").lower()
    if normal in (a.strip().rstrip("/").lower() for a in allowed):
        return True
    netloc = urlsplit(normal).netloc if "://" in normal else ""
    return bool(netloc) and netloc == host.strip().lower()


class BrowserGuard:
    """The Host and Origin checks above, for HTTP and WebSocket alike."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str], allowed_origins: list[str]):
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.allowed_hosts and not host_allowed(host, self.allowed_hosts):
            message = f"Host {host[:100]!r} is not allowed (allowed_hosts={self.allowed_hosts})"
            await refuse(scope, receive, send, APIError(400, message, None, "host_not_allowed"))
            return
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, host, self.allowed_origins):
            message = (
                f"Origin {origin[:100]!r} is not allowed: only pages of this server, or of "
                f"allowed_origins={self.allowed_origins}, may call it"
            )
            await refuse(scope, receive, send, APIError(403, message, None, "origin_not_allowed"))
            return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Checks `Authorization: Bearer KEY` on HTTP routes (WebSocket: checked in its handler)."""

    def __init__(self, app: ASGIApp, api_key: list[str]):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in OPEN_PATHS
            and not has_api_key(Headers(scope=scope), self.api_key)
        ):
            error = APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY'",
                None,
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def add_guards(app: FastAPI, settings: GatewaySettings) -> None:
    """Install the checks, innermost first (FastAPI runs the last one added first)."""
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(
        BrowserGuard,
        allowed_hosts=settings.allowed_hosts,
        allowed_origins=settings.allowed_origins,
    )
