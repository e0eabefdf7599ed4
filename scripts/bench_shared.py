"""A shared machine: a third-party load generator (aiperf) on the same cores as the server.

    python scripts/bench_shared.py [--model demo] [--servers actorserve,hf-serve] \
        [--concurrency 1,4,16] [--num-requests 32] [--aiperf PATH] [--json PATH]

Each server in turn serves the checkpoint over HTTP on 127.0.0.1, and aiperf sends
`--num-requests` streamed chat completions (~100-token synthetic prompts, 64 output tokens) at
each fixed concurrency in turn, after 4 warm-up requests. aiperf is a multi-process load
generator that itself needs CPU, so the server shares the cores as it would beside any busy
neighbour: this is both the serving comparison through the gateway and the shared-machine case.
Servers:

  actorserve       `actorserve serve` with its defaults (plus `--actorserve-flags`)
  actorserve-spin  the same with libgomp's default spin (`--omp-spin-count 300000`): what the
                   Worker's OpenMP threads did before omp_spin_count
  hf-serve         `transformers serve --continuous-batching --device cpu` (the checkpoint's dtype)

aiperf is not a dependency of the project (it pins its own packages): install it in a virtual
environment of its own (`python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf`) and
pass `--aiperf /tmp/aiperf/bin/aiperf`. `transformers serve` needs `accelerate` beside torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

SERVERS = ("actorserve", "actorserve-spin", "hf-serve")
COLUMNS = [
    bc.Column("server", "server"),
    bc.Column("concurrency", "concurrency", "{:d}"),
    bc.Column("tok_s", "output tok/s", "{:.1f}"),
    bc.Column("ratio", "vs hf-serve", "{:.2f}x"),
    bc.Column("itl_p50", "ITL p50 ms", "{:.1f}"),
    bc.Column("itl_p99", "ITL p99 ms", "{:.1f}"),
    bc.Column("itl_spread", "p99/p50", "{:.2f}"),
    bc.Column("ttft_p50", "TTFT p50 ms", "{:.0f}"),
    bc.Column("e2e_p99", "E2E p99 s", "{:.2f}"),
]


def server_command(name: str, model_dir: Path, port: int, flags: list[str]) -> list[str]:
    if name == "hf-serve":
        return [
            str(Path(sys.executable).with_name("transformers")), "serve", str(model_dir),
            "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
    command = [
        sys.executable, "-m", "actorserve.cli", "serve", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), *flags,
    ]  # fmt: skip
    if name == "actorserve-spin":
        command += ["--omp-spin-count", "300000"]
    return command


def wait_for(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with code {process.returncode} before serving")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"no answer from {url} within {timeout_s:.0f} s")


def run_aiperf(args, model_dir: Path, port: int, concurrency: int, out: Path) -> dict:
    command = [
        args.aiperf, "profile", "--model", str(model_dir), "--url", f"http://127.0.0.1:{port}",
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(model_dir),
        "--concurrency", str(concurrency), "--request-count", str(args.num_requests),
        "--warmup-request-count", "4", "--prompt-input-tokens-mean", "100",
        "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.output_len),
        "--prompt-output-tokens-stddev", "0", "--ui-type", "none",
        "--output-artifact-dir", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())


def measure(args, name: str, model_dir: Path, tmp: Path) -> list[dict]:
    """One server started once, then aiperf at each concurrency in turn: a row each."""
    port = 8600 + SERVERS.index(name)
    log = open(tmp / f"{name}.log", "wb")
    command = server_command(name, model_dir, port, args.actorserve_flags.split())
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_for(f"http://127.0.0.1:{port}/v1/models", process, 600)
        for concurrency in args.concurrency:
            result = run_aiperf(args, model_dir, port, concurrency, tmp / f"{name}-{concurrency}")
            rows.append(row_of(name, concurrency, result))
            print(
                f"  {name} at concurrency {concurrency}: {rows[-1]['tok_s']:.1f} tok/s", flush=True
            )
    finally:
        process.terminate()
        process.wait(60)
    return rows


def row_of(name: str, concurrency: int, result: dict) -> dict:
    def stat(metric: str, key: str) -> float:
        return float(result[metric][key])

    itl_p50, itl_p99 = stat("inter_token_latency", "p50"), stat("inter_token_latency", "p99")
    return {
        "server": name,
        "concurrency": concurrency,
        "tok_s": stat("output_token_throughput", "avg"),
        "itl_p50": itl_p50,
        "itl_p99": itl_p99,
        "itl_spread": itl_p99 / itl_p50 if itl_p50 > 0 else None,
        "ttft_p50": stat("time_to_first_token", "p50"),
        "e2e_p99": stat("request_latency", "p99") / 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="a checkpoint kind or directory")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    parser.add_argument(
        "--concurrency", default="8", help="comma-separated fixed concurrencies, e.g. 1,4,16"
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf")
    parser.add_argument("--actorserve-flags", default="", help="extra serve flags, one string")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model_dir = bc.resolve_model(args.model)
    names = [s for s in args.servers.split(",") if s]
    for name in names:
        if name not in SERVERS:
            raise SystemExit(f"--servers: unknown {name!r}; known: {', '.join(SERVERS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="actorserve-shared-") as tmp:
        for name in names:
            rows.extend(measure(args, name, model_dir, Path(tmp)))
    baselines = {r["concurrency"]: r["tok_s"] for r in rows if r["server"] == "hf-serve"}
    for row in rows:
        baseline = baselines.get(row["concurrency"])
        row["ratio"] = row["tok_s"] / baseline if baseline else None
    print(
        f"{bc.model_label(args.model)}: aiperf on the same cores, concurrency "
        f"{','.join(map(str, args.concurrency))}, {args.num_requests} streamed chat requests "
        "of ~100 prompt and "
        f"{args.output_len} output tokens; {bc.machine_line(bc.default_threads())}"
    )
    print(bc.format_table(rows, COLUMNS))
    bc.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
