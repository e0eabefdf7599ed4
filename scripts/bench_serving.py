"""Online serving: latency and throughput under Poisson arrivals and at a fixed concurrency, through
the ZeroMQ SDK and through the gateway's OpenAI streaming endpoint, against one running engine.

    python scripts/bench_serving.py [--model demo] [--rates 1,2,4,8] [--concurrency 16]
                                    [--modes sdk,gateway] [--plot PATH] [--json PATH]

The script starts `actorserve serve --model DIR --address ipc://... --host 127.0.0.1 --port P`
(engine + gateway in one process tree). `sdk` requests go to the engine's client address through
`AsyncClient.generate`; `gateway` requests are POST /v1/completions with stream=true (token-id
prompts, ignore_eos, temperature 0), read as server-sent events by a small asyncio HTTP client.
Each load point sends `--num-requests` requests of a seeded workload of its own (random token-id
prompts, random output lengths; a fresh seed per door and point, so no point finds another's
prompts in the prefix cache) and measures per request:

  TTFT  time to the first streamed token
  TPOT  (end-to-end - TTFT) / (output tokens - 1)
  ITL   every gap between two successive streamed chunks of one request
  E2E   end-to-end latency

and per load point p50/p90/p99 of each, requests/s and output tokens/s (completed requests and
their tokens over the time from the first send to the last token). The plot shows TTFT, TPOT and
E2E (p50, p99 dotted) against the request rate, one line per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from serving_load import MODES, GatewayDoor, SDKDoor, run_point, summarize  # noqa: E402

# -- the server -------------------------------------------------------------------------------


class Server:
    """`actorserve serve` in a subprocess: engine at an ipc:// address, gateway on the port the
    system picks (`--port 0`; serve prints `actorserve: http://HOST:PORT` once it listens)."""

    def __init__(
        self,
        model_dir: Path,
        threads: int,
        ready_timeout_s: float = 300.0,
        flags: Sequence[str] = (),
    ):
        """`flags`: more `actorserve serve` flags."""
        self.tmp = tempfile.TemporaryDirectory(prefix="actorserve-serving-")
        self.address = f"ipc://{self.tmp.name}/client.sock"
        self.log_path = Path(self.tmp.name) / "serve.log"
        self.log = open(self.log_path, "wb")
        command = [
            sys.executable, "-m", "actorserve.cli", "serve", "--model", str(model_dir),
            "--address", self.address, "--host", "127.0.0.1", "--port", "0",
            "--torch-threads", str(threads), *flags,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"actorserve serve exited early:\n{self.tail()}")
            log = self.log_path.read_text(errors="replace")
            found = re.search(r"actorserve: http://[^\s:]+:(\d+)", log)
            if found:
                self.port = int(found.group(1))
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"actorserve serve was not ready in {ready_timeout_s:.0f} s")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
        self.tmp.cleanup()


# -- plot -------------------------------------------------------------------------------------


def plot(rows: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    points = [r for r in rows if r.get("rate") is not None and r.get("failed", 0) < r["requests"]]
    if not points:
        return "no rate points to plot"
    finite = [r["rate"] for r in points if math.isfinite(r["rate"])]
    inf_x = (max(finite) * 2) if finite else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    titles = ("time to first token", "time per output token", "end-to-end")
    for ax, metric, title in zip(axes, ("ttft", "tpot", "e2e"), titles):
        for mode in MODES:
            mine = sorted((r for r in points if r["mode"] == mode), key=lambda r: r["rate"])
            if not mine:
                continue
            xs = [r["rate"] if math.isfinite(r["rate"]) else inf_x for r in mine]
            (line,) = ax.plot(xs, [r[f"{metric}_p50_ms"] for r in mine], "o-", label=f"{mode} p50")
            ax.plot(xs, [r[f"{metric}_p99_ms"] for r in mine], "o:", color=line.get_color(),
                    label=f"{mode} p99")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = sorted({r["rate"] for r in points})
        ax.set_xticks([t if math.isfinite(t) else inf_x for t in ticks])
        ax.set_xticklabels([f"{t:g}" if math.isfinite(t) else "all" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s; rightmost = all at once)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    model = points[0].get("model", "")
    fig.suptitle(f"actorserve serving latency, {model} checkpoint, {bc.cpu_name()}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- main -------------------------------------------------------------------------------------

COLUMNS = [
    bc.Column("mode", "door"),
    bc.Column("load", "load"),
    bc.Column("requests", "reqs", "{:d}"),
    bc.Column("request_throughput", "req/s", "{:.2f}"),
    bc.Column("output_throughput", "out tok/s", "{:.0f}"),
    bc.Column("ttft_p50_ms", "TTFT p50", "{:.0f}"),
    bc.Column("ttft_p90_ms", "p90", "{:.0f}"),
    bc.Column("ttft_p99_ms", "p99", "{:.0f}"),
    bc.Column("tpot_p50_ms", "TPOT p50", "{:.1f}"),
    bc.Column("tpot_p90_ms", "p90", "{:.1f}"),
    bc.Column("tpot_p99_ms", "p99", "{:.1f}"),
    bc.Column("itl_p50_ms", "ITL p50", "{:.1f}"),
    bc.Column("itl_p90_ms", "p90", "{:.1f}"),
    bc.Column("itl_p99_ms", "p99", "{:.1f}"),
    bc.Column("e2e_p50_ms", "E2E p50", "{:.0f}"),
    bc.Column("e2e_p90_ms", "p90", "{:.0f}"),
    bc.Column("e2e_p99_ms", "p99", "{:.0f}"),
    bc.Column("failed", "failed", "{:d}"),
]


async def run_all(server: Server, args, vocab: int) -> list[dict]:
    doors = []
    for mode in args.modes:
        if mode == "sdk":
            doors.append(SDKDoor(server.address))
        else:
            doors.append(GatewayDoor("127.0.0.1", server.port))
    rows = []
    for door in doors:
        try:
            await door.open()
        except Exception as exc:  # noqa: BLE001
            print(f"{door.name}: not run ({type(exc).__name__}: {exc})", flush=True)
            continue
        warm = [bc.Request([7] * 16, 4), bc.Request([8] * 16, 4)]  # shares no prefix below
        await run_point(door, warm, None, None, args.seed)
        points = [(rate, None) for rate in args.rates]
        if args.concurrency:
            points.append((None, args.concurrency))
        for index, (rate, concurrency) in enumerate(points):
            load = f"concurrency {concurrency}" if concurrency else f"rate {rate:g}/s"
            print(f"  {door.name}: {load} ...", flush=True)
            seed = args.seed + 1000 * MODES.index(door.name) + index
            workload = bc.workload_from_flags(args, args.num_requests, vocab, seed)
            records = await run_point(door, workload, rate, concurrency, seed)
            row = {"model": bc.model_label(args.model), "mode": door.name, "load": load,
                   "rate": rate, "concurrency": concurrency, **summarize(records)}  # fmt: skip
            rows.append(row)
            print(
                f"    {row['request_throughput']:.2f} req/s, TTFT p50 "
                f"{row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms"
                + (f", {row['failed']} failed: {row.get('first_error')}" if row["failed"] else ""),
                flush=True,
            )
        await door.close()
    return rows


def parse_rates(text: str) -> list[float]:
    return [math.inf if r.strip() in ("inf", "max") else float(r) for r in text.split(",") if r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="checkpoint kind or directory")
    parser.add_argument("--modes", default=",".join(MODES), help="sdk, gateway (comma-separated)")
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4,8,inf"),
                        help="Poisson request rates in req/s; inf = all at once")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16, help="0: no fixed-concurrency run")
    parser.add_argument("--num-requests", type=int, default=32, help="per load point")
    bc.add_workload_flags(parser)
    parser.add_argument("--plot", default="bench_serving.png", help="PNG path ('' = no plot)")
    bc.add_common_flags(parser)
    args = parser.parse_args(argv)
    args.threads = args.threads or bc.default_threads()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - set(MODES):
        parser.error(f"--modes: known modes are {', '.join(MODES)}")
    machine = bc.machine_line(args.threads)
    model_dir = bc.resolve_model(args.model)
    vocab = bc.ModelShape.read(model_dir).vocab
    print(f"starting actorserve serve --model {model_dir} ...", flush=True)
    server = Server(model_dir, args.threads)
    try:
        rows = asyncio.run(run_all(server, args, vocab))
    finally:
        server.stop()
    notes = [
        "",
        f"Machine: {machine}; load after the run {bc.load_average():.2f}.",
        f"Workload per point: {args.num_requests} requests (seeds from {args.seed}), "
        f"{bc.workload_lengths(args)}, greedy. Latencies in ms.",
        "Token times: the SDK door stamps each delta with token ids, the gateway door each SSE "
        "chunk with text (text held back for an incomplete character or a possible stop string "
        "moves the gateway's stamps later).",
    ]
    if "gateway" in args.modes and not any(r["mode"] == "gateway" for r in rows):
        notes.append("gateway: not run (see above).")
    print()
    print(bc.format_table(rows, COLUMNS, notes=notes))
    if args.plot and rows:
        problem = plot(rows, args.plot)
        print(f"plot: {problem}" if problem else f"plot: {args.plot}")
    bc.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
