"""Helpers for the gateway tests: `actorserve serve` with its HTTP port, plain HTTP calls, and
raw sockets for clients that misbehave on purpose (a small receive window, hand-made frames).

One gateway (API key, small limits) is shared by every gateway test module of a session: starting
the five processes costs most of these tests' time. The shutdown test starts its own.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import threading
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
    "--health-timeout-s",
    "3",
    "--health-interval-s",
    "1",
    "--max-requests-per-socket",
    "3",
)
HEALTH_INTERVAL_S = 1.0  # /health and /ready of the shared gateway repeat an answer this long
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# the supervised processes of `actorserve serve`, as the roster names them
ACTORS_AND_GATEWAY = {"engine", "scheduler", "block_manager", "worker", "gateway"}


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
        server = _shared[key] = GatewayServer(model, *SHARED_FLAGS)
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


def streams_through_a_fault(
    server: GatewayServer, bodies: list[dict], fault=None, wait_s: float = 120.0
) -> list[tuple[str, str] | None]:
    """POST every /v1/completions body at once as an SSE stream; (text, finish reason) of each
    (None where a stream did not end within `wait_s`). With `fault`, call it once every stream
    has had its first events."""
    started = threading.Barrier(len(bodies) + 1)
    results: list = [None] * len(bodies)

    def stream(i: int) -> None:
        conn, response = open_stream(server, "/v1/completions", {**bodies[i], "stream": True})
        events = read_events(response, 3)
        started.wait()
        events += read_events(response)
        conn.close()
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        reason = next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"])
        results[i] = (text, reason)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    started.wait(wait_s)
    if fault is not None:
        fault()
    for thread in threads:
        thread.join(wait_s)
    return results


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


# -- raw sockets: clients that misbehave on purpose ---------------------------------------


def gauge(server, name: str) -> float:
    """One of the gateway's own gauges, from /metrics."""
    text = call(server, "GET", "/metrics", headers=AUTH).body.decode()
    line = next(x for x in text.splitlines() if x.startswith(f"actorserve_{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def raw_socket(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # before connect, so the window it advertises is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((server.host, server.port))
    return sock


def read_to_end(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """All the server sends until it closes the connection."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def ended(sock: socket.socket, timeout_s: float = 30.0) -> bool:
    """Whether the server closes (or resets) the connection within timeout_s; what it sent
    before is read and dropped."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def websocket_frame(payload: bytes) -> bytes:
    """One masked text frame, as a client sends it (RFC 6455 5.2)."""
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        head = bytes([0x81, 0x80 | n])
    else:
        head = bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def open_raw_websocket(server, rcvbuf: int) -> socket.socket:
    sock = raw_socket(server, rcvbuf)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /v1/stream HTTP/1.1\r\nHost: {server.host}:{server.port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server stopped reading, or dropped us: either is the point
