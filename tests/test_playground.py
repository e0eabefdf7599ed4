"""The playground page at `/`, in headless Chromium driven over the DevTools protocol.

Needs Debian's chromium (`apt-get install -y chromium`); skipped with that reason without it.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from gateway_support import API_KEY, shared_gateway
from websockets.asyncio.client import connect

from actorserve.messages.common import SamplingParams

CHROMIUM = Path("/usr/bin/chromium")
# Skipped only outside CI: scripts/test.sh installs chromium, so in CI a missing one is a failure.
pytestmark = pytest.mark.skipif(
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
                document.getElementById('api_key').value = '{API_KEY}';
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
    png = (tmp_path / "playground.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    print(f"screenshot: {tmp_path / 'playground.png'}")
