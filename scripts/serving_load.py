"""The load bench_serving puts on the engine: the two doors a request goes through (the ZeroMQ
SDK and the gateway's OpenAI streaming endpoint), the arrivals (Poisson at a rate, or a fixed
concurrency), what each request's stream records and the per-point summary of the records.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import bench_common as bc

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
