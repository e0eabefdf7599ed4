"""The HTTP/WebSocket gateway: a FastAPI app that reaches the Engine only through the SDK.

    GET  /                       playground page (static HTML + JS, streams from /v1/stream)
    WS   /v1/stream              many streamed requests per socket (see websocket.py)
    POST /v1/completions         OpenAI-compatible, stream true/false (see openai_routes.py)
    POST /v1/chat/completions    OpenAI-compatible, the checkpoint's chat template
    GET  /v1/models              the one served model
    GET  /health                 pushes a real one-token request through all actors; 503 if not
    GET  /metrics                Prometheus text format

Every error is OpenAI's JSON error shape. With an API key set, every route but /health and the
playground page needs `Authorization: Bearer KEY` (401 otherwise).

`create_app` builds the app; the CLI runs it with uvicorn on the Supervisor's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from pathlib import Path

import msgspec
import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from .client import AsyncClient, EngineError
from .metrics import CONTENT_TYPE
from .openai_protocol import APIError, ModelCard, ModelList, now
from .openai_routes import (
    ClientGone,
    chat_completions,
    completions,
    error_response,
    json_response,
)
from .service import Gateway, GatewaySettings
from .websocket import stream_endpoint

log = logging.getLogger("gateway")
PLAYGROUND = Path(__file__).with_name("static") / "playground.html"
OPEN_PATHS = ("/", "/health")  # no API key needed: the static page and the load balancer's probe


class APIKeyMiddleware:
    """Checks `Authorization: Bearer KEY` on HTTP routes (WebSocket: checked in its handler)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
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


def create_app(client: AsyncClient, settings: GatewaySettings, chat) -> FastAPI:
    """`chat`: the checkpoint's ChatTemplate (its tokenizer also names logprob tokens)."""
    gateway = Gateway(client, settings, chat)
    app = FastAPI(title="actorserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        gateway.metrics.error(exc.status)
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(
            APIError(exc.status_code, str(exc.detail), None, None, dict(exc.headers or {}))
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(APIError(400, str(exc), None, "invalid_request"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {exc}", None, "internal"))

    @app.post("/v1/completions")
    async def post_completions(request: Request) -> Response:
        return await completions(request, gateway)

    @app.post("/v1/chat/completions")
    async def post_chat_completions(request: Request) -> Response:
        return await chat_completions(request, gateway)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(
            settings.model_id, now(), root=settings.model_dir, max_model_len=settings.max_model_len
        )
        return json_response(ModelList([card]))

    @app.get("/health")
    async def health() -> Response:
        if gateway.draining:
            return json_response(
                {"status": "draining", "error": "the server is shutting down"}, 503
            )
        try:
            elapsed, reply = await gateway.probe()
        except EngineError as exc:
            roster = []
            try:
                roster = msgspec.to_builtins((await client.health(1.0)).actors)
            except EngineError:
                pass
            return json_response(
                {"status": "unavailable", "error": str(exc), "actors": roster}, 503
            )
        status = "ok" if reply.ok else "degraded"
        body = {
            "status": status,
            "probe_s": round(elapsed, 4),
            "actors": msgspec.to_builtins(reply.actors),
            "engine": msgspec.to_builtins(reply.stats),
        }
        return json_response(body, 200 if reply.ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            gateway.metrics.refresh((await client.health(2.0)).stats)
        except EngineError as exc:
            log.warning("metrics: no engine stats this scrape: %s", exc)
            gateway.metrics.refresh(None)
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE)

    page = PLAYGROUND.read_text()  # read once, served as is

    @app.get("/")
    async def playground() -> HTMLResponse:
        return HTMLResponse(page)

    @app.websocket("/v1/stream")
    async def stream(websocket: WebSocket) -> None:
        await stream_endpoint(websocket, gateway)

    return app


# -- running it -------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the CLI owns SIGTERM/SIGINT (drain, then stop)."""

    def capture_signals(self):  # uvicorn >= 0.29
        return contextlib.nullcontext()

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port). Raises OSError naming nothing else."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class HTTPGateway:
    """The app under uvicorn on the running event loop, talking to the Engine at `address`."""

    def __init__(self, engine_address: str, settings: GatewaySettings, host: str, port: int):
        self.engine_address = engine_address
        self.settings = settings
        self.host = host
        self.port = port
        self.task: asyncio.Task | None = None
        self._chat: asyncio.Future | None = None

    def prepare(self) -> None:
        """Bind the port (OSError if taken) and start loading the tokenizer in a thread, so
        both happen while the actors start."""
        from .chat_template import ChatTemplate

        self.sock = bind(self.host, self.port)
        self.port = self.sock.getsockname()[1]
        self._chat = asyncio.ensure_future(asyncio.to_thread(ChatTemplate, self.settings.model_dir))

    async def start(self) -> str:
        """Serve; return the base URL. Raises what stopped the tokenizer or the server."""
        if self._chat is None:
            self.prepare()
        sock = self.sock
        try:
            chat = await self._chat
        except BaseException:
            sock.close()
            raise
        self.client = AsyncClient(self.engine_address)
        self.app = create_app(self.client, self.settings, chat)
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            ws_per_message_deflate=False,
        )
        self.server = _Server(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.02)
        if self.task.done():
            self.task.result()  # raises what stopped it
            raise OSError("the HTTP server stopped during start-up")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def refuse_new(self) -> None:
        """From now on, answer 503 to new requests (those in flight go on)."""
        self.app.state.gateway.draining = True

    async def stop(self, grace_s: float = 5.0) -> None:
        """Let responses in flight finish (up to `grace_s`), close every connection, stop."""
        if self.task is not None:
            await self.app.state.gateway.wait_idle(grace_s)
            self.server.should_exit = True
            try:
                await self.task
            except (Exception, SystemExit) as exc:
                log.warning("HTTP server stopped with %r", exc)
        await self.client.close()
