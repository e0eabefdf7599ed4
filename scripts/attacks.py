"""Hostile input against a real `actorserve serve` (SDK socket and HTTP), one attack at a time:
after each, is the server still serving (a greedy completion over the SDK and over HTTP), which
processes were restarted, and how long the attack took. Prints a table.

    python scripts/attacks.py            # the tiny-llama test checkpoint
    python scripts/attacks.py --skip-flood
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

import zmq

from actorserve.gateway.blocking_client import Client
from actorserve.gateway.errors import EngineError
from actorserve.messages.common import SamplingParams
from actorserve.weights.checkpoints import ensure_checkpoint


class Server:
    def __init__(self, model: str):
        run_dir = tempfile.mkdtemp(prefix="actorserve-attacks-")
        self.address = f"ipc://{run_dir}/engine.sock"
        self.log_path = os.path.join(run_dir, "serve.log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actorserve.cli", "serve", "--model", model,
             "--address", self.address, "--port", "0", "--torch-threads", "2"],
            stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True,
        )  # fmt: skip
        first, second = self.proc.stdout.readline(), self.proc.stdout.readline()
        match = re.search(r"(http://\S+)", second)
        if "serving" not in first or not match:
            raise RuntimeError(f"the server did not start ({self.log_path})")
        url = urlsplit(match.group(1))
        self.host, self.port = url.hostname, url.port

    def restarts(self) -> dict[str, int] | None:
        try:
            with Client(self.address, timeout_s=10) as client:
                return {a.name: a.restarts for a in client.health(timeout_s=5).actors}
        except EngineError:
            return None

    def sdk_ok(self) -> bool:
        try:
            with Client(self.address, timeout_s=20) as client:
                done = client.complete("def f():", SamplingParams(temperature=0, max_tokens=8))
            return done.completion_tokens == 8
        except EngineError:
            return False

    def http(self, body: bytes, timeout: float = 60) -> str:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"}
            conn.request("POST", "/v1/completions", body, headers)
            response = conn.getresponse()
            text = response.read()[:120].decode(errors="replace")
            return f"{response.status} {text}"
        except (OSError, http.client.HTTPException) as exc:
            return f"{type(exc).__name__}"
        finally:
            conn.close()

    def http_ok(self) -> bool:
        body = {"prompt": "def f():", "max_tokens": 8, "temperature": 0}
        return self.http(json.dumps(body).encode()).startswith("200")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def raw_send(address: str, frames: list[bytes], read_s: float = 2.0) -> str:
    """Send frames on a fresh DEALER; how many replies came within `read_s` (or that the
    Engine stopped taking them: its queue stayed full for 30 s)."""
    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    for i, frame in enumerate(frames):
        if not socket.poll(30_000, zmq.POLLOUT):
            socket.close()
            ctx.term()
            return f"stuck after {i} frames: not read"
        socket.send(frame, zmq.NOBLOCK, copy=False)
    replies, deadline = 0, time.monotonic() + read_s
    while time.monotonic() < deadline:
        if socket.poll(100):
            socket.recv()
            replies += 1
    socket.close()
    ctx.term()
    return f"{replies} replies"


def attacks(server: Server, flood: bool):
    nested = b"\x91" * 200_000 + b"\xc0"
    yield "200 KB nested msgpack frame", lambda: raw_send(server.address, [nested])
    big = {"prompt": "hi", "n": 64, "min_tokens": 64, "max_tokens": 64}
    body = json.dumps({**big, "stop_token_ids": [0] * 3_000_000}, separators=(",", ":"))
    yield "HTTP stop_token_ids x 3M, n=64", lambda: server.http(body.encode(), timeout=90)
    if flood:
        yield "1M one-byte frames", lambda: raw_send(server.address, [b"x"] * 1_000_000)
    yield "1 GB frame", lambda: raw_send(server.address, [bytes(1 << 30)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tiny-llama test checkpoint")
    parser.add_argument("--skip-flood", action="store_true")
    args = parser.parse_args(argv)
    model = args.model or str(ensure_checkpoint("tiny-llama"))
    server = Server(model)
    rows = []
    try:
        for name, attack in attacks(server, not args.skip_flood):
            started = time.monotonic()
            outcome = attack()
            took = time.monotonic() - started
            time.sleep(5)  # let a supervisor notice a death, and restart
            alive = server.proc.poll() is None
            sdk, web = (server.sdk_ok(), server.http_ok()) if alive else (False, False)
            restarts = server.restarts() if alive else None
            restarted = (
                ",".join(f"{k}x{v}" for k, v in restarts.items() if v) or "none"
                if restarts is not None
                else "?"
            )
            rows.append((name, outcome[:40], took, alive, sdk, web, restarted))
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        server.stop()
    print(f"\n{'attack':<34}{'answer':<42}{'took':>7}  serve  SDK  HTTP  restarted")
    for name, outcome, took, alive, sdk, web, restarted in rows:
        yes = {True: "ok", False: "NO"}
        print(
            f"{name:<34}{outcome:<42}{took:>6.1f}s  {yes[alive]:<6} {yes[sdk]:<4} "
            f"{yes[web]:<5} {restarted}"
        )
    return 0 if all(r[3] and r[4] and r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
