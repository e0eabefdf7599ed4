"""Chaos run: greedy streams through the SDK and over HTTP while random processes of a real
`actorserve serve` (the four actors, the gateway) are SIGKILLed or SIGSTOPped.

Prints how many requests completed, how many outputs are identical to a fault-free run of the same
workload, the recovery time (fault injected -> replacement ready) p50 / max, and whether every KV
block came back. SDK streams ride out any death (the Engine's included: the SDK resumes them); an
HTTP stream cut by the gateway's death is retried by its client from the start, as a real client
would, and must then give the same text.

    python scripts/chaos.py --requests 200 --faults 20
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit

from actorserve.gateway.blocking_client import Client
from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineError
from actorserve.messages.common import SamplingParams
from actorserve.weights.checkpoints import ensure_checkpoint

VICTIMS = ("worker", "scheduler", "block_manager", "engine", "gateway")


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(rng.randint(4, 300))] for _ in range(n)]


class Server:
    """`actorserve serve --port 0` in a process group of its own."""

    def __init__(self, model: str, faults: int):
        run_dir = tempfile.mkdtemp(prefix="actorserve-chaos-")
        self.address = f"ipc://{run_dir}/engine.sock"
        self.log = open(os.path.join(run_dir, "serve.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actorserve.cli", "serve", "--model", model, "--address",
             self.address, "--port", "0", "--heartbeat-interval-s", "0.5",
             "--max-restarts", str(faults + 1), "--max-concurrent-requests", "4096"],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        lines = [self.proc.stdout.readline(), self.proc.stdout.readline()]
        match = re.search(r"actorserve: (http://\S+)", lines[1])
        if "serving" not in lines[0] or not match:
            raise RuntimeError(f"the server did not start: {lines} (log: {self.log.name})")
        url = urlsplit(match.group(1))
        self.host, self.port = url.hostname, url.port

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


async def sdk_workload(address: str, prompts, params: SamplingParams):
    async with AsyncClient(address, timeout_s=300) as client:

        async def one(prompt):
            try:
                return [t async for d in client.generate(prompt, params) for t in d.token_ids]
            except EngineError as exc:
                return exc

        return await asyncio.gather(*[one(p) for p in prompts])


def http_stream(server: Server, prompt: list[int], max_tokens: int, retries: list) -> str | None:
    """The text of one streamed completion; a cut stream (no [DONE]) is retried from the start,
    up to 20 times (each retry is counted in `retries`)."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
         "stream": True}
    ).encode()  # fmt: skip
    for _ in range(20):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status == 200:
                text, done = [], False
                for line in response:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: "):
                        choices = json.loads(line[6:])["choices"]
                        text += [c["text"] for c in choices]
                if done:
                    return "".join(text)
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        retries.append(time.monotonic())
        time.sleep(0.2)
    return None


def http_workload(server: Server, prompts, max_tokens: int, retries: list) -> list:
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = http_stream(server, prompts[i], max_tokens, retries)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def roster(client: Client) -> dict:
    try:
        return {a.name: a for a in client.health(timeout_s=5).actors}
    except EngineError:
        return {}


def inject_faults(address: str, count: int, gap_s: float, rng: random.Random, log: list):
    """Kill or freeze a random process, wait for its replacement, `count` times."""
    with Client(address) as client:
        for _ in range(count):
            time.sleep(gap_s * rng.uniform(0.5, 1.5))
            victim = rng.choice(VICTIMS)
            how = rng.choice([signal.SIGKILL, signal.SIGSTOP])
            pid = roster(client)[victim].pid
            started = time.monotonic()
            os.kill(pid, how)
            while True:
                now = roster(client).get(victim)
                if now and now.pid != pid and now.state == "ready":
                    break
                if time.monotonic() - started > 120:
                    raise RuntimeError(f"{victim} did not come back within 120 s")
                time.sleep(0.02)
            # observed: an upper bound (a health reply waits up to 2 s for a dead Scheduler's
            # stats); supervisor: from noticing the death to the replacement ready and reset
            log.append((victim, how.name, time.monotonic() - started, now.last_recovery_s))


def blocks_back(address: str, timeout_s: float = 20.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            stats = client.health().stats
            if stats.blocks_free == stats.blocks_total or time.monotonic() > deadline:
                return stats.blocks_free, stats.blocks_total
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tiny-llama test checkpoint")
    parser.add_argument("--requests", type=int, default=48, help="SDK streams (HTTP: a quarter)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--gap-s", type=float, default=1.5, help="mean time between faults")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = args.model or str(ensure_checkpoint("tiny-llama"))
    prompts = workload(args.requests, args.seed)
    web_prompts = workload(max(1, args.requests // 4), args.seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    server = Server(model, args.faults)
    try:
        reference = asyncio.run(sdk_workload(server.address, prompts, params))
        web_reference = http_workload(server, web_prompts, args.max_tokens, [])
        faults: list[tuple[str, str, float, float]] = []
        retries: list[float] = []
        injector = threading.Thread(
            target=inject_faults,
            args=(server.address, args.faults, args.gap_s, random.Random(args.seed), faults),
        )
        started = time.monotonic()
        injector.start()
        web: list = []
        web_thread = threading.Thread(
            target=lambda: web.extend(http_workload(server, web_prompts, args.max_tokens, retries))
        )
        web_thread.start()
        outputs = asyncio.run(sdk_workload(server.address, prompts, params))
        web_thread.join()
        injector.join()
        elapsed = time.monotonic() - started
        free, total = blocks_back(server.address)
    finally:
        code = server.stop()
    completed = sum(not isinstance(o, EngineError) for o in outputs)
    identical = sum(o == r for o, r in zip(outputs, reference))
    web_identical = sum(w == r and w is not None for w, r in zip(web, web_reference))
    recoveries = [supervisor_s for *_, supervisor_s in faults]
    print(f"\n{'faults':<28}{len(faults)}   (recovery: supervisor's measure / observed bound)")
    for victim, how, observed, supervisor_s in faults:
        print(f"  {how:<8} {victim:<16} back in {supervisor_s:6.2f} s / {observed:6.2f} s")
    print(f"{'SDK streams completed':<28}{completed}/{len(prompts)}")
    print(f"{'  identical to fault-free':<28}{identical}/{len(prompts)}")
    print(f"{'HTTP streams identical':<28}{web_identical}/{len(web_prompts)}"
          f"   ({len(retries)} retried after a cut connection)")  # fmt: skip
    if recoveries:
        print(
            f"{'recovery p50 / max':<28}{statistics.median(recoveries):.2f} s / "
            f"{max(recoveries):.2f} s"
        )
    print(f"{'KV blocks free / total':<28}{free}/{total}")
    print(f"{'workload wall time':<28}{elapsed:.1f} s")
    print(f"{'serve exit code':<28}{code}")
    ok = completed == identical == len(prompts) and web_identical == len(web_prompts)
    return 0 if ok and free == total and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
