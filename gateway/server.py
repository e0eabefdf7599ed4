"""The HTTP/WebSocket gateway: a FastAPI app that reaches the Engine only through the SDK.

    GET  /                       playground page (static HTML + JS, streams from /v1/stream)
    WS   /v1/stream              many streamed requests per socket (see websocket.py)
    POST /v1/completions         OpenAI-compatible, stream true/false, a batch of prompts
                                 (see openai_completions.py)
    POST /v1/chat/completions    OpenAI-compatible, the checkpoint's chat template
    GET  /v1/models              the one served model
    GET  /health                 liveness: the Engine answers (no generation); see health.py
    GET  /ready                  readiness: every actor ready, and one token through them all
                                 (at most once per health_interval_s)
    GET  /metrics                Prometheus text format
    GET  /v1/stats               the engine's load now and over the last minutes, JSON (the
                                 playground's charts; see live_stats.py)

Every error is OpenAI's JSON error shape. Host, Origin (browsers, CORS) and the API key are
checked in guards.py: with a key set, every route but the page, /health and /ready needs
`Authorization: Bearer KEY` (401 otherwise). Connection limits and timeouts: connections.py.

`create_app` builds the app; HTTPGateway runs it under uvicorn, in the gateway's own
supervised process (gateway/process.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .client import AsyncClient
from .connections import GatewayConfig
from .curve_keys import ClientKeys
from .errors import EngineError
from .guards import add_guards, has_api_key
from .health import HealthChecks
from .kv_events import KvEventFeed
from .kv_index import ReplicaIndex
from .kv_routing import KvRouter
from .live_stats import StatsHistory
from .metrics import CONTENT_TYPE
from .openai_completions import completions
from .openai_errors import APIError
from .openai_responses import ModelCard, ModelList, now
from .openai_routes import ClientGone, chat_completions, error_response, json_response
from .replicas import ReplicaSet
from .service import Gateway, GatewaySettings
from .websocket import stream_endpoint

log = logging.getLogger("gateway")
PLAYGROUND = Path(__file__).with_name("static") / "playground.html"


def create_app(client: ReplicaSet, settings: GatewaySettings, chat) -> FastAPI:
    """`chat`: the checkpoint's ChatTemplate (its tokenizer also names logprob tokens)."""
    gateway = Gateway(client, settings, chat)
    app = FastAPI(title="actorserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    checks = HealthChecks(client, settings)
    history = StatsHistory(
        client, settings.model_id, settings.stats_interval_s, settings.stats_window_s
    )
    add_guards(app, settings)

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
    async def health(request: Request) -> Response:
        authorized = has_api_key(request.headers, settings.api_key)
        return await checks.respond(checks.live, gateway.draining, authorized)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        authorized = has_api_key(request.headers, settings.api_key)
        return await checks.respond(checks.ready, gateway.draining, authorized)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            gateway.metrics.refresh((await client.health(2.0)).stats)
        except EngineError as exc:
            log.warning("metrics: no engine stats this scrape: %s", exc)
            gateway.metrics.refresh(None)
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/stats")
    async def stats() -> Response:
        try:
            return json_response(await history.get())
        except EngineError:  # its text may name the engine's address: not for HTTP callers
            message = f"the engine did not answer a stats query within {history.timeout_s:g} s"
            raise APIError(503, message, None, "unavailable") from None

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
    """The app under uvicorn on the running event loop, talking to the Engine at `address`, or
    to the replicas `settings.replicas` names when it names any."""

    def __init__(
        self,
        engine_address: str,
        settings: GatewaySettings,
        host: str,
        port: int,
        engine_keys: list[ClientKeys | None] | None = None,
    ):
        """`engine_keys`: the CurveZMQ keys of each engine it talks to (the replicas, else the
        one at `engine_address`), by position; None or empty: none has keys."""
        self.engine_address = engine_address
        self.engine_keys = engine_keys or []
        self.settings = settings
        self.host = host
        self.port = port
        self.task: asyncio.Task | None = None
        self._chat: asyncio.Future | None = None
        self.feed: KvEventFeed | None = None

    def prepare(self, sock: socket.socket | None = None) -> None:
        """Bind the port (OSError if taken), or take `sock`, a listening socket bound already,
        and start loading the tokenizer in a thread."""
        from .chat_template import ChatTemplate

        self.sock = sock if sock is not None else bind(self.host, self.port)
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
        settings = self.settings
        addresses = settings.replicas or [self.engine_address]
        keys = self.engine_keys or [None] * len(addresses)
        self.engine_keys = keys
        clients = [self._engine_client(address, i) for i, address in enumerate(addresses)]
        kv = None
        if settings.route_policy == "kv_events" and len(addresses) > 1:
            indexes = [
                ReplicaIndex(settings.route_kv_max_blocks, settings.block_size) for _ in addresses
            ]
            try:
                self.feed = KvEventFeed(addresses, keys, indexes, settings.route_kv_message_bytes)
            except ValueError as exc:  # an address with no events beside it: affinity alone
                log.warning("route_policy kv_events: %s; routing by prefix affinity", exc)
        if self.feed is not None:
            kv = KvRouter(
                indexes,
                settings.block_size,
                settings.route_kv_prompt_blocks,
                settings.route_kv_assume_s,
                settings.route_kv_tie,
                settings.route_kv_steps_ahead,
                settings.route_kv_load_margin,
            )
            self.feed.start()
        self.client = ReplicaSet(
            clients,
            settings.block_size,
            settings.route_prefix_blocks,
            settings.route_load_margin,
            settings.health_interval_s,
            chat.tokenizer.encode,
            kv_high=settings.route_kv_high,
            stats_interval_s=settings.route_stats_interval_s,
            policy=settings.route_policy,
            kv=kv,
        )
        self.app = create_app(self.client, self.settings, chat)
        config = GatewayConfig(
            self.app,
            self.settings,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            ws_per_message_deflate=False,
        )
        self.server = _Server(config)
        self.app.state.gateway.connections = self.server.server_state.connections
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.02)
        if self.task.done():
            self.task.result()  # raises what stopped it
            raise OSError("the HTTP server stopped during start-up")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _engine_client(self, address: str, index: int) -> AsyncClient:
        """An SDK client of replica `index` at `address`, with that replica's keys."""
        key = self.engine_keys[index]
        return AsyncClient(
            address,
            liveness_timeout_s=self.settings.engine_liveness_timeout_s,
            **(key.options() if key is not None else {}),
        )

    def lose_replica(self, index: int, reason: str) -> None:
        """Replica `index` is gone (ReplicaSet.lose)."""
        self.client.lose(index, reason)

    def move_replica(self, index: int, address: str) -> None:
        """Replica `index` serves at `address` from now on (ReplicaSet.move)."""
        self.client.move(index, self._engine_client(address, index))
        if self.feed is not None:
            try:
                self.feed.move(index, address)
            except ValueError as exc:  # no events beside the new address: affinity for it
                log.warning("replica %d moved; its KV events: %s", index, exc)

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
        if self.feed is not None:
            await self.feed.close()
