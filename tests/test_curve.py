"""tcp:// that is safe to open: CurveZMQ keys from `actorserve keys`, an engine that refuses to
serve tcp:// without them (loopback aside, when asked), the SDK and the HTTP gateway through a
CURVE engine, and clients without the right keys that hear nothing while the engine goes on
serving the others."""

from __future__ import annotations

import http.client
import json
import re
import socket
import stat
import subprocess
import sys
import time

import pytest
import zmq

from actorserve.gateway.curve_keys import (
    client_options,
    load_server_public_key,
    secure_dealer,
    write_keys,
)
from actorserve.messages.client import EngineToClient, GenerateRequest, HealthReply, HealthRequest
from actorserve.messages.codec import Decoder, encode
from actorserve.messages.common import SamplingParams
from support import EngineServer, hf_greedy, prompts_of_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_refused(model, *flags: str) -> subprocess.CompletedProcess:
    """`actorserve serve` that is expected to give up before any actor starts."""
    cmd = [sys.executable, "-m", "actorserve.cli", "serve", "--model", str(model), "--port", "0"]
    return subprocess.run(cmd + list(flags), capture_output=True, text=True, timeout=60)


def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "actorserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("curve") / "keys")


@pytest.fixture(scope="module")
def curve_server(llama_dir, keys):
    """An engine on tcp://127.0.0.1 with CURVE and one authorized client (the SDK's)."""
    server = EngineServer(
        llama_dir,
        "--curve-server-key",
        str(keys["server_secret"]),
        "--curve-authorized-clients",
        str(keys["authorized_client"].parent),
        address=f"tcp://127.0.0.1:{free_port()}",
        client_options=client_options(keys["server_public"], keys["client_secret"]),
    )
    line = server._read_line(120)  # the gateway's URL, after the engine's line
    match = re.fullmatch(r"actorserve: http://127\.0\.0\.1:(\d+)\n?", line)
    assert match, f"gateway did not start: {line!r}\n{server.log()}"
    server.http_port = int(match.group(1))
    yield server
    server.stop()


def test_keys_writes_two_key_pairs_no_one_else_may_read_and_never_overwrites(tmp_path):
    target = tmp_path / "keys"
    done = cli("keys", str(target))
    assert done.returncode == 0, done.stderr
    assert "--curve-server-key" in done.stdout
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    files = ["server.key", "server.key_secret", "client.key", "client.key_secret"]
    for name in files + ["authorized_clients/client.key"]:
        assert stat.S_IMODE((target / name).stat().st_mode) == 0o600, name
    before = {name: (target / name).read_bytes() for name in files}
    again = cli("keys", str(target))
    assert again.returncode != 0 and "never overwrites" in again.stderr
    assert {name: (target / name).read_bytes() for name in files} == before


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "192.0.2.7"])
def test_tcp_beyond_loopback_without_keys_is_refused_before_any_actor_starts(llama_dir, host):
    started = time.monotonic()
    done = serve_refused(
        llama_dir, "--address", f"tcp://{host}:{free_port()}", "--insecure-loopback", "true"
    )
    assert done.returncode != 0
    assert "without CurveZMQ" in done.stderr and "actorserve keys" in done.stderr
    assert "--curve-server-key" in done.stderr
    assert "serving" not in done.stdout
    assert time.monotonic() - started < 30  # no actor started (no model load)


def test_tcp_on_loopback_without_keys_needs_insecure_loopback(llama_dir):
    done = serve_refused(llama_dir, "--address", f"tcp://127.0.0.1:{free_port()}")
    assert done.returncode != 0
    assert "--insecure-loopback true" in done.stderr and "actorserve keys" in done.stderr


def test_authorized_clients_without_a_server_key_are_refused(llama_dir, keys):
    done = serve_refused(
        llama_dir, "--curve-authorized-clients", str(keys["authorized_client"].parent)
    )
    assert done.returncode != 0 and "--curve-server-key" in done.stderr


def test_tcp_on_loopback_with_insecure_loopback_serves_without_keys(llama_dir):
    server = EngineServer(
        llama_dir, "--insecure-loopback", "true", address=f"tcp://127.0.0.1:{free_port()}"
    )
    try:
        prompt = prompts_of_lengths(llama_dir, [12])[0]
        assert server.client.complete(prompt, GREEDY).token_ids == hf_greedy(llama_dir, prompt, 8)
    finally:
        assert server.stop() == 0


def test_the_sdk_streams_a_greedy_completion_through_curve(curve_server, llama_dir):
    prompt = prompts_of_lengths(llama_dir, [20])[0]
    deltas = list(curve_server.client.generate(prompt, GREEDY))
    assert deltas[-1].finish_reason is not None
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(llama_dir, prompt, 8)


def test_the_http_gateway_reaches_a_curve_engine_with_its_own_key(curve_server):
    conn = http.client.HTTPConnection("127.0.0.1", curve_server.http_port, timeout=60)
    try:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        reply = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 200, reply
    assert reply["usage"]["completion_tokens"] >= 1


def probe(address: str, options: dict, timeout_s: float = 3.0):
    """A HealthRequest and a GenerateRequest from a fresh DEALER with these SDK options; the
    first reply decoded, or None when nothing came (or could not even be queued) in time. Raw
    zmq with send and receive timeouts: the SDK's sends wait for a pipe, which a socket whose
    handshake failed no longer has."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    secure_dealer(sock, options.get("server_public_key"), options.get("client_keys"))
    try:
        sock.connect(address)
        sock.send(encode(HealthRequest("probe")))
        sock.send(encode(GenerateRequest("stranger", "Hello", None, GREEDY)))
        return Decoder(EngineToClient).decode(sock.recv())
    except zmq.Again:
        return None
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("who", ["no keys", "unauthorized key", "another server's key"])
def test_a_client_without_the_right_keys_hears_nothing_and_the_others_go_on(
    curve_server, keys, tmp_path, who, llama_dir
):
    if who == "no keys":
        options = {}
    elif who == "unauthorized key":  # knows the server's key, but its own is not authorized
        options = {"server_public_key": load_server_public_key(keys["server_public"])}
    else:  # authorized, but expects another server: the handshake fails
        other = write_keys(tmp_path / "other")
        options = client_options(other["server_public"], keys["client_secret"])
    assert probe(curve_server.address, options) is None
    authorized = client_options(keys["server_public"], keys["client_secret"])
    assert isinstance(probe(curve_server.address, authorized), HealthReply)  # the probe works
    prompt = prompts_of_lengths(llama_dir, [9])[0]
    assert curve_server.client.complete(prompt, GREEDY).token_ids == hf_greedy(llama_dir, prompt, 8)
    if who == "unauthorized key":
        assert "refused a client with unauthorized key" in curve_server.log()


def test_status_reaches_a_curve_engine_with_the_key_flags(curve_server, keys):
    done = cli(
        "status",
        "--address",
        curve_server.address,
        "--curve-server-public-key",
        str(keys["server_public"]),
        "--curve-client-key",
        str(keys["client_secret"]),
    )
    assert done.returncode == 0, done.stderr
    assert "engine" in done.stdout
