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
import json
import math
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

MODES = ("sdk", "gateway")


@dataclass
class Record:
    start: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival time of each streamed chunk
    end: float = 0.0
    output_tokens: int = 0
    error: str | None = None


# -- the two doors ----------------------------------------------------------------------------


class SDKDoor:
    name = "sdk"

    def __init__(self, address: str):
        self.address = address
        self.client = None

    async def open(self) -> None:
        from actorserve.gateway.client import AsyncClient

        self.client = AsyncClient(self.address)

    async def close(self) -> None:
        await self.client.close()

    async def send(self, request: bc.Request, record: Record) -> None:
        from actorserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        record.start = time.perf_counter()
        async for delta in self.client.generate(list(request.prompt_ids), params):
            now = time.perf_counter()
            if delta.token_ids:
                record.chunks.append(now)
                record.output_tokens += len(delta.token_ids)
            if delta.finished:
                record.output_tokens = delta.completion_tokens or record.output_tokens
        record.end = time.perf_counter()


class GatewayDoor:
    """POST /v1/completions (stream=true) over a fresh HTTP/1.1 connection per request."""

    name = "gateway"

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.model_id = None

    async def open(self) -> None:
        status, body = await self._get("/v1/models")
        if status != 200:
            raise RuntimeError(f"GET /v1/models answered {status}: {body[:200]!r}")
        self.model_id = json.loads(body)["data"][0]["id"]

    async def close(self) -> None:
        pass

    async def _get(self, path: str) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        request = f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nConnection: close\r\n\r\n"
        writer.write(request.encode())
        await writer.drain()
        data = await reader.read()
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            body = b"".join(_dechunk_all(body))
        return status, body

    async def send(self, request: bc.Request, record: Record) -> None:
        payload = json.dumps(
            {
                "model": self.model_id,
                "prompt": list(request.prompt_ids),
                "max_tokens": request.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Accept: text/event-stream\r\nConnection: close\r\n\r\n"
        ).encode()
        record.start = time.perf_counter()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(head + payload)
            await writer.drain()
            status_line = await reader.readline()
            status = int(status_line.split(b" ", 2)[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            if status != 200:
                record.error = f"HTTP {status}: {(await reader.read())[:200]!r}"
                return
            chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            buffer = b""
            async for piece in _body_pieces(reader, chunked):
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if self._event(event, record):
                        record.end = time.perf_counter()
                        return
        finally:
            writer.close()
        record.end = time.perf_counter()

    @staticmethod
    def _event(event: bytes, record: Record) -> bool:
        """Handle one SSE event; True at [DONE]."""
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            chunk = json.loads(data)
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                record.chunks.append(time.perf_counter())
            usage = chunk.get("usage")
            if usage:
                record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        return False


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF
        yield data


def _dechunk_all(body: bytes):
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            return
        yield rest[:size]
        body = rest[size + 2 :]


# -- load generation --------------------------------------------------------------------------


async def run_point(door, workload: list[bc.Request], rate: float | None, concurrency: int | None,
                    seed: int) -> list[Record]:  # fmt: skip
    """Poisson arrivals at `rate` req/s (inf: all at once), or `concurrency` requests in flight."""
    records = [Record() for _ in workload]

    async def one(i: int) -> None:
        try:
            await door.send(workload[i], records[i])
        except Exception as exc:  # noqa: BLE001 - reported per request
            records[i].error = f"{type(exc).__name__}: {exc}"
            records[i].end = time.perf_counter()

    if concurrency:
        queue = iter(range(len(workload)))

        async def worker() -> None:
            for i in queue:
                await one(i)

        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return records
    rng = random.Random(seed)
    start = time.perf_counter()
    at, tasks = 0.0, []
    for i in range(len(workload)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
        if rate is not None and math.isfinite(rate):
            at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return records


def summarize(records: list[Record]) -> dict:
    ok = [r for r in records if r.error is None and r.chunks]
    ttft = [r.chunks[0] - r.start for r in ok]
    e2e = [r.end - r.start for r in ok]
    tpot = [(r.end - r.chunks[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    duration = max(r.end for r in records) - min(r.start for r in records)
    row = {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for p, v in bc.percentiles(values).items():
            row[f"{name}_{p}_ms"] = v * 1e3
        row[f"{name}_mean_ms"] = (sum(values) / len(values) * 1e3) if values else float("nan")
    errors = [r.error for r in records if r.error]
    if errors:
        row["first_error"] = errors[0]
    return row


# -- the server -------------------------------------------------------------------------------


class Server:
    """`actorserve serve` in a subprocess: engine at an ipc:// address, gateway on the port the
    system picks (`--port 0`; serve prints `actorserve: http://HOST:PORT` once it listens)."""

    def __init__(self, model_dir: Path, threads: int, ready_timeout_s: float = 300.0):
        self.tmp = tempfile.TemporaryDirectory(prefix="actorserve-serving-")
        self.address = f"ipc://{self.tmp.name}/client.sock"
        self.log_path = Path(self.tmp.name) / "serve.log"
        self.log = open(self.log_path, "wb")
        command = [
            sys.executable, "-m", "actorserve.cli", "serve", "--model", str(model_dir),
            "--address", self.address, "--host", "127.0.0.1", "--port", "0",
            "--torch-threads", str(threads),
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
            workload = bc.make_workload(
                args.num_requests, seed, (args.min_prompt_len, args.max_prompt_len),
                (args.min_output_len, args.max_output_len), vocab,
            )  # fmt: skip
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
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
        f"Workload per point: {args.num_requests} requests (seeds from {args.seed}), random "
        f"token-id prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, outputs of "
        f"{args.min_output_len}-{args.max_output_len} tokens, ignore_eos, greedy. Latencies in ms.",
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
