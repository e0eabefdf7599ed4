"""What the benchmark scripts share, one place for each: checkpoints, the seeded workload, the
machine (its line in every table, its GEMM peak and memory read speed, the processes' CPU time),
percentiles, the printed table and its --json file. The floor is in floor.py.

Every script imports this module as `bench_common` (scripts/ is put on sys.path by the script
itself), so `python scripts/bench_X.py` and `actorserve bench X` behave the same.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINT_KINDS = ("demo", "llama-125m", "llama-350m")


# -- checkpoints ------------------------------------------------------------------------------


def resolve_model(name: str) -> Path:
    """A checkpoint kind built by actorserve.weights.checkpoints (CHECKPOINT_KINDS), or a
    directory."""
    path = Path(name)
    if path.is_dir():
        return path
    from actorserve.weights.checkpoints import ensure_checkpoint

    return ensure_checkpoint(name)


def model_label(name: str) -> str:
    return Path(name).name if Path(name).is_dir() else name


@dataclass(frozen=True)
class ModelShape:
    """What the matmul-work count needs of a checkpoint's config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str = "float32"  # the checkpoint's, as config.json says (float32 when it does not)

    @classmethod
    def read(cls, model_dir: Path) -> ModelShape:
        """Through actorserve's own config.json parser (the one place that reads it)."""
        from actorserve.actors.runtime.model_config import ModelConfig

        c = ModelConfig.from_dir(Path(model_dir))
        return cls(
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            layers=c.num_layers,
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            vocab=c.vocab_size,
            dtype=c.dtype or "float32",
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the decoder layers' projections (q, k, v, o, gate, up, down), all layers."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def kv_values_per_token(self) -> int:
        """K and V values of one token in every layer (times the K/V dtype's size: bytes)."""
        return self.layers * 2 * self.kv_heads * self.head_dim

    def gemm_shapes(self, tokens: int = 2048, samples: int = 64) -> list[tuple[int, int, int]]:
        """(M, K, N) of the model's own matmuls: a full prefill step and a decode step's head."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return [
            (tokens, self.hidden, q + 2 * kv),  # qkv
            (tokens, self.hidden, 2 * self.intermediate),  # gate_up
            (tokens, self.intermediate, self.hidden),  # down
            (samples, self.hidden, self.vocab),  # lm_head over the sampling rows
        ]


# -- workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    output_len: int


def make_workload(
    num_requests: int,
    seed: int,
    prompt_len: tuple[int, int] = (16, 512),
    output_len: tuple[int, int] = (16, 256),
    vocab_size: int = 32000,
    first_id: int = 5,
) -> list[Request]:
    """nano-vllm's bench workload: random token ids (above the special ones), random prompt and
    output lengths drawn uniformly from the inclusive ranges; outputs run to their length
    (ignore_eos)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        ids = [rng.randrange(first_id, vocab_size) for _ in range(n)]
        requests.append(Request(ids, rng.randint(*output_len)))
    return requests


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """--seed and the prompt and output length ranges (make_workload's defaults)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)


def workload_from_flags(
    args: argparse.Namespace, num_requests: int, vocab: int, seed: int | None = None
) -> list[Request]:
    """make_workload with add_workload_flags' ranges; `seed` (default --seed) picks the draw."""
    prompt_len = (args.min_prompt_len, args.max_prompt_len)
    output_len = (args.min_output_len, args.max_output_len)
    return make_workload(
        num_requests, args.seed if seed is None else seed, prompt_len, output_len, vocab
    )


def workload_lengths(args: argparse.Namespace) -> str:
    """add_workload_flags' ranges as the tables' notes say them."""
    return (
        f"random token-id prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, "
        f"outputs of {args.min_output_len}-{args.max_output_len} tokens, ignore_eos"
    )


# -- the machine ------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine_line(threads: int) -> str:
    import torch

    return (
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} with {threads} threads, "
        f"load {load_average():.2f}, {time.strftime('%Y-%m-%d %H:%M')}{cpu_idle()}"
    )


def cpu_idle() -> str:
    """How the CPUs idle, where Linux says: in a VM with cpuidle-haltpoll, how long a virtual
    CPU polls before it halts (with 0 every wake-up of an idle CPU is a trip through the
    hypervisor: the ipc round trip's floor)."""
    cpuidle = Path("/sys/devices/system/cpu/cpuidle")
    try:
        driver = (cpuidle / "current_driver").read_text().strip()
    except OSError:
        return ""
    try:
        poll_ns = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns").read_text().strip()
        return f", cpuidle {driver} (guest_halt_poll_ns {poll_ns})"
    except OSError:
        return f", cpuidle {driver}"


def default_threads() -> int:
    """What the Worker uses by default (EngineConfig.torch_threads None: every core)."""
    return os.cpu_count() or 1


def measure_gemm_flops(
    shapes: list[tuple[int, int, int]],
    threads: int,
    dtype: str = "float32",
    repeats: int = 7,
    min_time_s: float = 0.05,
) -> dict[str, float]:
    """torch.mm FLOP/s in `dtype` (float32, bfloat16), best of `repeats`, for each (M, K, N);
    'peak' is the best of all.

    The roofline the throughput is compared to: what this process reaches on the model's own
    matmul shapes with the Worker's thread count, measured in the same run."""
    import torch

    torch_dtype = getattr(torch, dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    result: dict[str, float] = {}
    try:
        for m, k, n in shapes:
            a, b = torch.randn(m, k, dtype=torch_dtype), torch.randn(k, n, dtype=torch_dtype)
            out = torch.empty(m, n, dtype=torch_dtype)
            torch.mm(a, b, out=out)
            start = time.perf_counter()
            inner = 0
            while time.perf_counter() - start < min_time_s or inner < 2:
                torch.mm(a, b, out=out)
                inner += 1
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(inner):
                    torch.mm(a, b, out=out)
                best = min(best, (time.perf_counter() - start) / inner)
            result[f"{m}x{k}x{n}"] = 2.0 * m * k * n / best
    finally:
        torch.set_num_threads(previous)
    result["peak"] = max(result.values())
    time.sleep(0.5)  # let the OpenMP pool stop spinning before other processes need the cores
    return result


def streaming_read_gb_s(num_bytes: int, threads: int | None = None, slices: int = 4) -> float:
    """What a read of `num_bytes` of float32 from memory can reach, GB/s: the best of 8 passes
    each of a sum and of a dot product with itself (which of torch's two kernels streams closer
    to the memory's speed depends on the CPU), each pass over the next of `slices` such buffers,
    so that the others went through the caches since it was last read; with `threads` torch
    threads (default: as set)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    n = max(1, num_bytes // 4)
    x = torch.ones(slices * n)
    best = float("inf")
    try:
        for read in (torch.sum, lambda part: torch.dot(part, part)):
            for i in range(2 * slices):
                part = x[(i % slices) * n : (i % slices + 1) * n]
                start = time.perf_counter()
                read(part)
                best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return num_bytes / best / 1e9


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process and of each child, by name: `driver` for this
    one (with its supervisor thread), the actor's name for an actorserve actor process (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    result: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        pid, ppid = int(entry), int(fields[1])
        if pid != me and ppid != me:
            continue
        name = "driver"
        if pid != me:
            module = next((w for w in command.split() if w.startswith("actorserve.")), command[:40])
            name = module.rsplit(".", 1)[-1]
        result[name] = result.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return result


# -- statistics -------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def percentiles(values: list[float], ps: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    return {f"p{int(p) if float(p).is_integer() else p}": percentile(values, p) for p in ps}


# -- output -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = "{}"  # applied to numbers; strings print as they are


def format_table(
    rows: list[dict[str, Any]], columns: list[Column], title: str = "", notes: list[str] = ()
) -> str:
    """A Markdown table (renders in the README, reads fine in a terminal)."""

    def cell(row: dict[str, Any], col: Column) -> str:
        value = row.get(col.key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return col.fmt.format(value)
        return str(value)

    def numeric(col: Column) -> bool:
        return any(
            isinstance(r.get(col.key), (int, float)) and not isinstance(r.get(col.key), bool)
            for r in rows
        )

    body = [[cell(r, c) for c in columns] for r in rows]
    widths = [max([len(c.header)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    right = [numeric(c) for c in columns]
    lines = [title] if title else []
    lines.append("| " + " | ".join(c.header.ljust(w) for c, w in zip(columns, widths)) + " |")
    lines.append(
        "|" + "|".join("-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right)) + "|"
    )
    for b in body:
        cells = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(b, widths, right)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.extend(notes)
    return "\n".join(lines)


def write_json(path: str | None, rows: list[dict[str, Any]]) -> None:
    """The table as a JSON list, one object per row; numbers (ratios included) stay numbers."""
    if not path:
        return

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(
        json.dumps([{k: clean(v) for k, v in row.items()} for row in rows], indent=2) + "\n"
    )


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the table here")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the Worker, the Hugging Face runs and the GEMM roofline "
        "(default: every core, as the Worker)",
    )
