"""Helpers for the gateway tests: `actorserve serve` with its HTTP port, plain HTTP calls.

One gateway (API key, small limits) is shared by every gateway test module of a session: starting
the five processes costs most of these tests' time. The shutdown test starts its own.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

from support import EngineServer

API_KEY = "test-key-123"
SHARED_FLAGS = (
    "--api-key",
    API_KEY,
    "--max-concurrent-requests",
    "4",
    "--max-body-bytes",
    "65536",
    "--max-model-len",
    "512",
    "--heartbeat-interval-s",
    "5",
)
SHARED_ENV = {"ACTORSERVE_HEALTH_TIMEOUT_S": "3"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class GatewayServer(EngineServer):
    """`actorserve serve --port 0`: the SDK address (as EngineServer) plus `url`, the HTTP base."""

    def __init__(self, model: Path, *flags: str, env: dict[str, str] | None = None):
        super().__init__(model, *flags, env=env)  # EngineServer already serves with --port 0
        line = self._read_line(120)
        match = re.fullmatch(r"actorserve: (http://\S+)\n?", line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"gateway did not start: {line!r}\n{self.log()}")
        self.url = match.group(1)
        self.model_name = str(model)  # the id clients pass as `model`: --model as given
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port

    def connection(self, timeout: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)


_shared: dict[tuple, GatewayServer] = {}


def shared_gateway(pytestconfig, model: Path) -> GatewayServer:
    """The session's shared gateway, started on first use and stopped when pytest ends."""
    key = (str(model), SHARED_FLAGS)
    if key not in _shared:
        server = _shared[key] = GatewayServer(model, *SHARED_FLAGS, env=SHARED_ENV)
        pytestconfig.add_cleanup(server.stop)
    return _shared[key]


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)


def call(
    server: GatewayServer, method: str, path: str, body=None, headers=None, raw: bytes | None = None
) -> Reply:
    """One HTTP request; `body` goes as JSON, `raw` as it is."""
    conn = server.connection()
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, data, all_headers)
        response = conn.getresponse()
        return Reply(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )
    finally:
        conn.close()


def open_stream(server: GatewayServer, path: str, body: dict, headers=None):
    """POST a streaming request; (connection, response) with the response's lines unread."""
    conn = server.connection()
    conn.request(
        "POST",
        path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    response = conn.getresponse()
    return conn, response


def read_events(response, count: int | None = None) -> list[str]:
    """SSE `data:` payloads, up to `count` of them (all, to the end, when None)."""
    events: list[str] = []
    while count is None or len(events) < count:
        line = response.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(line[len(b"data: ") :].rstrip(b"\n").decode())
    return events


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
