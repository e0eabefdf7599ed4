"""Start-up and restart times: `actorserve serve` to ready, then each process SIGKILLed in turn
and the supervisor's own figure for its recovery (ActorStatus.last_recovery_s: from noticing the
death to the replacement Ready and the Reset sent; it includes the 0.05 s restart backoff).

    python scripts/bench_start.py --model weights/demo-python --repeats 3 [-- SERVE FLAGS...]

Prints one row per process (the median of `--repeats` kills) and the serve-to-ready time (the
median of `--starts` cold starts of `actorserve serve --port 0`). A restart should cost what the
process must load, not its imports (docs/operations.md, Supervision).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import write_json

from actorserve.gateway.blocking_client import Client
from actorserve.gateway.errors import EngineError

VICTIMS = ("scheduler", "block_manager", "engine", "gateway", "worker")


class Server:
    """`actorserve serve --port 0`; `ready_s`: from the spawn to the URL line on stdout."""

    def __init__(self, model: str, flags: list[str]):
        run_dir = tempfile.mkdtemp(prefix="actorserve-start-")
        self.address = f"ipc://{run_dir}/engine.sock"
        self.log = open(os.path.join(run_dir, "serve.log"), "w")
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actorserve.cli", "serve", "--model", model, "--address",
             self.address, "--port", "0", "--max-restarts", "1000", "--restart-window-s", "1",
             *flags],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        for line in self.proc.stdout:
            if line.startswith("actorserve: http"):
                break
        else:
            raise RuntimeError(f"the server did not start (log: {self.log.name})")
        self.ready_s = time.monotonic() - started

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def roster(client: Client) -> dict:
    try:
        return {a.name: a for a in client.health(timeout_s=5).actors}
    except EngineError:
        return {}


def cpu_s(pid: int) -> float:
    """The CPU time (user + system) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def recovery_s(client: Client, victim: str) -> tuple[float, float]:
    """SIGKILL `victim`, wait for its replacement: the supervisor's recovery time, and the CPU
    time the replacement took to get there (less sensitive to a busy machine)."""
    pid = roster(client)[victim].pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = roster(client).get(victim)
        if now and now.pid != pid and now.state == "ready" and now.last_recovery_s > 0:
            return now.last_recovery_s, cpu_s(now.pid)
        time.sleep(0.05)
    raise RuntimeError(f"{victim} did not come back within 120 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="weights/demo-python")
    parser.add_argument("--repeats", type=int, default=3, help="kills of each process")
    parser.add_argument("--starts", type=int, default=3, help="cold starts of serve")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the table here")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="after --: more serve flags")
    args = parser.parse_args(argv)
    flags = [f for f in args.flags if f != "--"]
    ready = []
    for _ in range(args.starts - 1):
        server = Server(args.model, flags)
        ready.append(server.ready_s)
        server.stop()
    server = Server(args.model, flags)
    ready.append(server.ready_s)
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in VICTIMS}
    try:
        with Client(server.address) as client:
            for _ in range(args.repeats):
                for victim in VICTIMS:
                    time.sleep(1.5)  # past --restart-window-s: the backoff stays the first one
                    times[victim].append(recovery_s(client, victim))
    finally:
        server.stop()
    print(
        f"model {args.model} {' '.join(flags)}; {os.cpu_count()} CPUs; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"| process | restart s (median of {args.repeats}) | its CPU s | all restarts |")
    print("|---|---|---|---|")
    rows = []
    for victim, values in times.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        every = ", ".join(f"{w:.2f}" for w, _ in values)
        print(f"| {victim} | {wall:.2f} | {cpu:.2f} | {every} |")
        rows.append({"process": victim, "restart_s": wall, "cpu_s": cpu, "all_s": every})
    every = ", ".join(f"{v:.2f}" for v in ready)
    print(f"| serve to ready | {statistics.median(ready):.2f} | | {every} |")
    rows.append(
        {"process": "serve to ready", "restart_s": statistics.median(ready), "all_s": every}
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
