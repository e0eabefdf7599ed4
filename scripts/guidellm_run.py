"""guidellm, unchanged, against `actorserve serve` on loopback: a bounded run that checks a
third-party load generator gets answers (0 errors) and prints what it measured.

    python scripts/guidellm_run.py [--model tiny-llama] [--streams 4] [--requests 16] \
        [--guidellm PATH] [--json PATH]

guidellm sends streamed /v1/completions of synthetic prompts (`--prompt-tokens` tokens counted
with the checkpoint's own tokenizer: the model name is its local directory, so nothing is
downloaded) at a fixed concurrency until
`--requests` have completed or `--max-seconds` have passed. guidellm pins its own packages: install
it in a virtual environment of its own (`python -m venv /tmp/guidellm && /tmp/guidellm/bin/pip
install guidellm==0.8.1`) and pass `--guidellm /tmp/guidellm/bin/guidellm`. aiperf, the other
load generator, runs the same way in scripts/bench_shared.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from bench_shared import wait_for  # noqa: E402

COLUMNS = [
    bc.Column("requests", "requests ok", "{}"),
    bc.Column("errors", "errors", "{}"),
    bc.Column("tok_s", "output tok/s", "{:.1f}"),
    bc.Column("ttft_p50", "TTFT p50 ms", "{:.0f}"),
    bc.Column("itl_p50", "ITL p50 ms", "{:.1f}"),
    bc.Column("e2e_p50", "E2E p50 s", "{:.2f}"),
]


def guidellm_command(args, model_dir: Path, port: int, out: Path) -> list[str]:
    lengths = f"prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    data = f"kind=synthetic_text,{lengths}"
    return [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={model_dir}",
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--constraint", f"kind=max_duration,seconds={args.max_seconds}",
        "--constraint", "kind=max_errors,count=1",
        "--data", data,
        "--output", f"kind=json,path={out / 'guidellm.json'}",
        "--disable-console-interactive",
    ]  # fmt: skip


def summary(report: dict) -> dict:
    """The run's counts and medians from guidellm's JSON report (its first benchmark)."""
    benchmark = report["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    metrics = benchmark["metrics"]

    def median(name: str) -> float:
        return float(metrics[name]["successful"]["median"])

    return {
        "requests": totals["successful"],
        "errors": totals["errored"],
        "tok_s": float(metrics["output_tokens_per_second"]["successful"]["mean"]),
        "ttft_p50": median("time_to_first_token_ms"),
        "itl_p50": median("inter_token_latency_ms"),
        "e2e_p50": median("request_latency"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="a checkpoint kind or directory")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-seconds", type=int, default=120)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8640)
    parser.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm")
    parser.add_argument("--json", default=None, help="write the row here")
    args = parser.parse_args(argv)
    model_dir = bc.resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="actorserve-guidellm-") as tmp:
        out = Path(tmp)
        log = open(out / "serve.log", "wb")
        server = subprocess.Popen(
            [sys.executable, "-m", "actorserve.cli", "serve", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", str(args.port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_for(f"http://127.0.0.1:{args.port}/v1/models", server, 600)
            done = subprocess.run(
                guidellm_command(args, model_dir, args.port, out), capture_output=True, text=True
            )
            if done.returncode != 0:
                raise SystemExit(f"guidellm failed ({done.returncode}):\n{done.stderr[-3000:]}")
            row = summary(json.loads((out / "guidellm.json").read_text()))
        finally:
            server.terminate()
            server.wait(60)
    print(
        f"{bc.model_label(args.model)}: guidellm {args.streams} concurrent streams, "
        f"{args.requests} completions of {args.prompt_tokens} prompt and {args.output_tokens} "
        f"output tokens; {bc.machine_line(bc.default_threads())}"
    )
    print(bc.format_table([row], COLUMNS))
    bc.write_json(args.json, [row])
    return 1 if row["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
