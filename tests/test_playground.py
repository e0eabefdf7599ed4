"""The playground page at `/`, in headless Chromium driven over the DevTools protocol, and the
live engine stats it charts (GET /v1/stats).

The page tests need Debian's chromium (`apt-get install -y chromium`); skipped with that reason
without it.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from gateway_support import API_KEY, AUTH, call, shared_gateway, wait_until
from websockets.asyncio.client import connect

from actorserve.gateway.live_stats import StatsHistory
from actorserve.messages.client import EngineStats
from actorserve.messages.common import SamplingParams

CHROMIUM = Path("/usr/bin/chromium")
# Skipped only outside CI: scripts/test.sh installs chromium, so in CI a missing one is a failure.
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists() and not os.environ.get("CI"),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)",
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-port=0",
    "--window-size=1100,800",
]


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


class Page:
    """Just enough of the DevTools protocol: send a command, wait for its reply or an event."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    async def send(self, method: str, **params) -> dict:
        sent = next(self.ids)
        await self.ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:
            message = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
            if message.get("id") == sent:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    async def wait_event(self, method: str, timeout_s: float = 30.0) -> dict:
        async def wait():
            while True:
                for event in self.events:
                    if event.get("method") == method:
                        self.events.remove(event)
                        return event
                self.events.append(json.loads(await self.ws.recv()))

        return await asyncio.wait_for(wait(), timeout_s)

    async def eval(self, expression: str):
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")


# The stats panel as the page shows it; tps_ys: the tok/s line's y (44 is zero, 2 the top).
PANEL = """({
    samples: Number(document.getElementById('stats').dataset.samples),
    running: document.getElementById('stat-running').textContent,
    waiting: document.getElementById('stat-waiting').textContent,
    kv: document.getElementById('stat-kv').textContent,
    note: document.getElementById('stats-note').textContent,
    tps_ys: (document.getElementById('line-tps').getAttribute('points') || '')
        .split(' ').filter(Boolean).map(p => Number(p.split(',')[1])),
})"""


def start_chromium(profile: Path) -> tuple[subprocess.Popen, str]:
    """Chromium with an empty profile; (process, DevTools websocket URL of its page)."""
    profile.mkdir()
    proc = subprocess.Popen(
        [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        match = re.search(r"DevTools listening on ws://([^/]+)/", line)
        if match:
            break
    else:
        raise RuntimeError(f"chromium exited with {proc.wait()} before DevTools came up")
    with urllib.request.urlopen(f"http://{match.group(1)}/json/list", timeout=10) as reply:
        pages = [t for t in json.load(reply) if t["type"] == "page"]
    return proc, pages[0]["webSocketDebuggerUrl"]


@needs_chromium
async def test_the_playground_streams_a_completion_into_the_page(gateway, tmp_path):
    prompt, max_tokens = "def fibonacci(n):", 48
    expected = gateway.client.complete(
        prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )
    proc, page_url = start_chromium(tmp_path / "profile")
    try:
        async with connect(page_url, max_size=64 * 1024 * 1024) as ws:
            page = Page(ws)
            await page.send("Page.enable")
            await page.send("Page.navigate", url=gateway.url + "/")
            await page.wait_event("Page.loadEventFired")
            assert await page.eval("document.title") == "actorserve playground"
            # With the key, the stats panel fills in: a sample from before the run.
            await page.eval(f"document.getElementById('api_key').value = '{API_KEY}'")
            for _ in range(200):
                if (await page.eval(PANEL))["samples"] >= 1:
                    break
                await asyncio.sleep(0.05)
            # Record every text the output shows, then fill in the form and press Run.
            await page.eval(f"""
                window.seen = [];
                new MutationObserver(() => {{
                    const g = document.getElementById('generated');
                    if (g) window.seen.push(g.textContent);
                }}).observe(document.getElementById('output'),
                            {{childList: true, subtree: true, characterData: true}});
                document.getElementById('prompt').value = {json.dumps(prompt)};
                document.getElementById('max_tokens').value = '{max_tokens}';
                document.getElementById('temperature').value = '0';
                document.getElementById('repetition_penalty').value = '1';
                document.getElementById('run').click();
            """)
            state = None
            for _ in range(1200):
                state = await page.eval(
                    "({state: document.getElementById('status').dataset.state,"
                    " status: document.getElementById('status').textContent,"
                    " text: document.getElementById('generated').textContent,"
                    " deltas: Number(document.getElementById('output').dataset.deltas),"
                    " seen: window.seen})"
                )
                if state["state"] in ("done", "error"):
                    break
                await asyncio.sleep(0.05)
            # Beside the text, the engine's load: the run's tokens show in the tok/s chart.
            panel = None
            for _ in range(300):
                panel = await page.eval(PANEL)
                if panel["samples"] >= 2 and any(y < 44 for y in panel["tps_ys"]):
                    break
                await asyncio.sleep(0.05)
            shot = await page.send("Page.captureScreenshot", format="png")
            (tmp_path / "playground.png").write_bytes(base64.b64decode(shot["data"]))
    finally:
        proc.terminate()
        proc.wait(10)

    assert state["state"] == "done", state["status"]
    assert state["text"] == expected.text and expected.text
    assert state["status"].startswith(
        f"{expected.finish_reason.value}: {expected.completion_tokens} tokens"
    )
    # Tokens showed up as they arrived: several deltas, each growing the text on the page.
    growing = [t for t in dict.fromkeys(state["seen"]) if t]
    assert state["deltas"] > 1 and len(growing) > 1
    assert all(expected.text.startswith(t) for t in growing)
    assert panel["samples"] >= 2, panel
    assert panel["running"].isdigit() and panel["waiting"].isdigit(), panel
    assert re.fullmatch(r"\d+\.\d% of [1-9]\d* blocks", panel["kv"]), panel
    assert any(y < 44 for y in panel["tps_ys"]), f"no output tokens/s drawn: {panel}"
    assert panel["note"] == "", panel
    png = (tmp_path / "playground.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    print(f"screenshot: {tmp_path / 'playground.png'}")


# -- GET /v1/stats ---------------------------------------------------------------------------


def test_stats_need_the_api_key(gateway):
    reply = call(gateway, "GET", "/v1/stats")
    assert reply.status == 401, reply.body


def test_stats_show_a_streaming_request_live(gateway):
    """While requests stream, a sample counts them running, their KV blocks in use and their
    tokens per second; the history keeps every sample of the window, oldest first."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stop = threading.Event()
    before = call(gateway, "GET", "/v1/stats", headers=AUTH).json()

    def keep_one_streaming() -> None:  # a finished request is replaced until the test has seen one
        while not stop.is_set():
            gateway.client.complete("def fibonacci(n):", params)

    streamer = threading.Thread(target=keep_one_streaming, daemon=True)
    streamer.start()
    try:

        def busy_sample():
            body = call(gateway, "GET", "/v1/stats", headers=AUTH).json()
            now = body["now"]
            busy = now["num_running"] >= 1 and now["output_tokens_per_s"] > 0
            return body if busy and now["kv_cache_usage"] > 0 else None

        live = wait_until(busy_sample, timeout_s=60, interval_s=0.2)
    finally:
        stop.set()
        streamer.join(120)
    assert live, "no sample showed the streaming request"
    assert live["generation_tokens"] > before["generation_tokens"]
    assert 0 < live["blocks_free"] < live["blocks_total"]
    assert live["now"]["kv_cache_usage"] == pytest.approx(
        1 - live["blocks_free"] / live["blocks_total"], abs=1e-3
    )
    # a few hundred greedy tokens of the tiny model a second, not thousands or fractions
    assert 1 < live["now"]["output_tokens_per_s"] < 100_000
    history = live["history"]
    assert history[-1] == live["now"] and len(history) >= 2
    times = [sample["at"] for sample in history]
    assert times == sorted(times) and times[-1] - times[0] <= live["window_s"]
    assert abs(times[-1] - time.time()) < 30


def test_stats_rate_is_the_counter_change_over_time_and_never_negative():
    history = StatsHistory(client=None, model="m", interval_s=1.0, window_s=10.0)
    stats = lambda tokens: EngineStats(generation_tokens=tokens, blocks_total=8, blocks_free=6)
    assert history.add(100.0, 1000.0, stats(50)).output_tokens_per_s == 0  # nothing before it
    assert history.add(102.0, 1002.0, stats(250)).output_tokens_per_s == 100
    assert history.add(103.0, 1003.0, stats(20)).output_tokens_per_s == 0  # a new Engine's counter
    sample = history.add(111.0, 1011.0, stats(70))
    assert sample.output_tokens_per_s == 6.25 and sample.kv_cache_usage == 0.25
    # samples older than the window are dropped; the newest is last
    assert [s.at for s in history.samples()] == [1002.0, 1003.0, 1011.0]
