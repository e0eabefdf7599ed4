"""The HTTP gateway is a supervised process of its own: its death gives its clients a clean
connection error, it comes back on the same port, and the Engine aborts the requests it had in
flight (no orphan runs to max_tokens, no KV block leaked)."""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time

from gateway_support import GatewayServer, call, open_stream, read_events

from support import prompts_of_lengths


def actor(server, name):
    return next(a for a in server.client.health().actors if a.name == name)


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_killed_gateway_gives_clean_errors_comes_back_and_leaks_nothing(llama_dir):
    server = GatewayServer(llama_dir)
    try:
        gateway = actor(server, "gateway")
        assert gateway.state == "ready" and gateway.pid not in (server.proc.pid, 0)
        prompts = prompts_of_lengths(llama_dir, [10, 30, 50, 70])
        started = threading.Barrier(len(prompts) + 1)
        endings: list = [None] * len(prompts)

        def stream(i: int) -> None:
            body = {"model": server.model_name, "prompt": prompts[i], "stream": True}
            body.update(max_tokens=2000, ignore_eos=True, temperature=0)
            conn, response = open_stream(server, "/v1/completions", body)
            read_events(response, 2)
            started.wait()
            try:
                events = read_events(response)
                endings[i] = events[-1] if events else "closed"
            except (http.client.HTTPException, ConnectionError) as exc:
                endings[i] = type(exc).__name__
            finally:
                conn.close()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        started.wait()
        assert server.client.health().stats.num_running == len(prompts)
        os.kill(gateway.pid, signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads)  # every client saw the end: no hang
        assert "[DONE]" not in endings  # ended by the connection, not as if complete
        # The Engine aborted what the dead gateway had asked for: nothing runs on for nobody.
        wait_until(lambda: server.client.health().stats.num_running == 0, 15, "the aborts")
        stats = server.wait_blocks_free()
        assert stats.blocks_free == stats.blocks_total
        wait_until(
            lambda: (
                actor(server, "gateway").pid != gateway.pid
                and actor(server, "gateway").state == "ready"
            ),
            30,
            "a new gateway",
        )
        reply = call(
            server,
            "POST",
            "/v1/completions",
            {"model": server.model_name, "prompt": "def f():", "max_tokens": 5},
        )
        assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 5
        assert actor(server, "gateway").restarts == 1
        assert {a.name: a.restarts for a in server.client.health().actors}["engine"] == 0
    finally:
        assert server.stop() == 0
