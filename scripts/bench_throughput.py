"""Offline throughput: actorserve against Hugging Face transformers, same checkpoint, same workload,
one run, one machine.

    python scripts/bench_throughput.py [--model demo llama-125m llama-350m] [--dtypes auto,float32]
                                       [--num-requests N] [--json PATH]

Default: the three checkpoints, 64 requests on demo (fp32), 8 on llama-125m (fp32, 27 times
demo's decoder matmul work per token) and 16 on llama-350m (bf16 on disk, as released checkpoints
ship), all three backends at each of `--dtypes`: `auto` is the checkpoint's own dtype (what
`--dtype auto` serves on a CPU with native bf16, and what a transformers user gets), `float32` the
fp32 rows (one row where the two are the same).

The workload is nano-vllm's bench (bench_common.make_workload): random token-id prompts of 16-512
tokens and outputs of 16-256 tokens, ignore_eos, greedy. It runs

  actorserve   the real actor processes through the offline API, LLM(...).generate(...)
  hf-static    transformers `generate`, static batches of 16 in arrival order, left padding,
               max_new_tokens = min_new_tokens = the batch's longest output
  hf-cb        transformers continuous batching (the manager behind `generate_batch`), with each
               request's own max_new_tokens (`generate_batch` takes one for all, so the script
               adds the requests to the same manager itself with `add_request`)

each in a fresh Python process (the workload is rebuilt there from the seed), and prints wall
time, output and total tokens/s, actorserve's speed-up over each (at the same dtype), and the
fraction of the GEMM roofline: the workload's matmul work (floor.matmul_flops) / wall time / the
best torch.mm FLOP/s at the row's dtype measured on the model's own shapes in this run, same
thread count; and how close each comes to the floor at its dtype (floor.Floor): the least time
any engine with weights and K/V of that dtype could take on the workload at that GEMM peak and
at the memory read speed measured in the run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from floor import engine_floor, matmul_flops  # noqa: E402
from hf_baselines import run_hf_cb, run_hf_static  # noqa: E402

BACKENDS = ("actorserve", "hf-static", "hf-cb")
# The 125M checkpoint does many times the matmul work per token: fewer requests keep the default
# run (both checkpoints, all three backends) short enough for a small machine.
DEFAULT_REQUESTS = {"demo": 64, "llama-125m": 8, "llama-350m": 16}
VALUE_BYTES = {"float32": 4, "bfloat16": 2}
READ_PROBE_BYTES = 64 << 20  # the order of a 64-decode step's K/V on the demo checkpoint


def run_actorserve(model_dir: Path, workload: list[bc.Request], args) -> dict:
    from actorserve import LLM, SamplingParams

    settings = dict(torch_threads=args.threads, dtype=args.dtype)
    if args.max_num_seqs:
        settings["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.no_async_scheduling:
        settings["async_scheduling"] = False
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=True)
        for r in workload
    ]
    with LLM(str(model_dir), **settings) as llm:
        warm = [[7 + i] * 32 for i in range(4)]  # shares no prefix with the workload
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), False)
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_ids for r in workload], params, use_tqdm=not args.quiet)
        wall = time.perf_counter() - start
    got = [len(o.token_ids) for o in outputs]
    short = sum(1 for o, r in zip(got, workload) if o != r.output_len)
    if short:
        print(f"actorserve: {short} requests did not return their full output", file=sys.stderr)
    return {"wall_s": wall, "output_tokens": sum(got), "tokens": [o.token_ids for o in outputs]}


RUNNERS = {"actorserve": run_actorserve, "hf-static": run_hf_static, "hf-cb": run_hf_cb}
CHILD_FLAG = "--child-result"  # internal: run one backend in this process, write its result


def run_isolated(backend: str, name: str, dtype: str, num_requests: int, args) -> dict:
    """Run one backend in a fresh Python process (its own threads, allocator and OpenMP teams,
    nothing left over from the runs before it); the same workload is rebuilt there from the
    seed."""
    with tempfile.TemporaryDirectory(prefix="actorserve-bench-") as tmp:
        out = Path(tmp) / "result.json"
        # The parent's own flags, then the child's: argparse keeps the last of a repeated flag.
        command = [sys.executable, str(Path(__file__).resolve()), *args.argv]
        command += ["--model", name, "--backends", backend, "--num-requests", str(num_requests)]
        command += ["--dtypes", dtype]
        subprocess.run([*command, CHILD_FLAG, str(out)], check=True)
        return json.loads(out.read_text())


COLUMNS = [
    bc.Column("model", "model"),
    bc.Column("backend", "backend"),
    bc.Column("dtype", "dtype"),
    bc.Column("requests", "requests", "{:d}"),
    bc.Column("wall_s", "wall s", "{:.2f}"),
    bc.Column("output_tok_s", "output tok/s", "{:.0f}"),
    bc.Column("total_tok_s", "total tok/s", "{:.0f}"),
    bc.Column("actorserve_speedup", "actorserve x", "{:.2f}"),
    bc.Column("matmul_gflop_s", "matmul GFLOP/s", "{:.1f}"),
    bc.Column("roofline_fraction", "of roofline", "{:.1%}"),
    bc.Column("floor_fraction", "floor / wall", "{:.1%}"),
    bc.Column("greedy_match", "same tokens", "{:.0%}"),
]


def dtypes_for(shape: bc.ModelShape, asked: list[str]) -> list[str]:
    """`--dtypes` resolved for one checkpoint (auto: its own dtype), each once, in order."""
    resolved = [shape.dtype if d == "auto" else d for d in asked]
    return list(dict.fromkeys(resolved))


def bench_model(name: str, args) -> list[dict]:
    model_dir = bc.resolve_model(name)
    shape = bc.ModelShape.read(model_dir)
    n = args.num_requests or DEFAULT_REQUESTS.get(bc.model_label(name), 64)
    workload = bc.workload_from_flags(args, n, shape.vocab)
    work = matmul_flops(shape, workload)
    prompt_tokens = sum(len(r.prompt_ids) for r in workload)
    read_gb_s = bc.streaming_read_gb_s(READ_PROBE_BYTES, args.threads)
    print(
        f"{bc.model_label(name)} ({shape.dtype} on disk): {n} requests, {prompt_tokens} prompt + "
        f"{sum(r.output_len for r in workload)} output tokens, {work / 1e9:.0f} GFLOP of matmul; "
        f"memory reads {read_gb_s:.1f} GB/s",
        flush=True,
    )
    rows = []
    for dtype in dtypes_for(shape, args.dtypes):
        rows.extend(bench_dtype(name, dtype, shape, workload, read_gb_s, args))
    return rows


def bench_dtype(
    name: str, dtype: str, shape: bc.ModelShape, workload: list[bc.Request], read_gb_s, args
) -> list[dict]:
    """Every backend on one checkpoint at one dtype, against that dtype's floor."""
    n = len(workload)
    gemm = bc.measure_gemm_flops(shape.gemm_shapes(), args.threads, dtype)
    size = VALUE_BYTES[dtype]
    floor = engine_floor(shape, workload, gemm["peak"], read_gb_s * 1e9, size, size)
    work = matmul_flops(shape, workload)
    prompt_tokens = sum(len(r.prompt_ids) for r in workload)
    print(
        f"  {dtype}: GEMM peak {gemm['peak'] / 1e9:.0f} GFLOP/s "
        f"({', '.join(f'{k} {v / 1e9:.0f}' for k, v in gemm.items() if k != 'peak')}); "
        f"floor {floor.serial_s:.2f} s = {work / floor.serial_s / gemm['peak']:.1%} of the "
        f"roofline (prefill {floor.prefill_s:.2f}, decode GEMMs {floor.gemm_s:.2f}, K/V reads "
        f"{floor.kv_s:.2f}); {floor.overlapped_s:.2f} s with the K/V reads hidden under the GEMMs",
        flush=True,
    )
    rows = []
    results = {}
    for backend in args.backends:
        print(f"  running {backend} ({dtype}) ...", flush=True)
        runs = sorted(
            (run_isolated(backend, name, dtype, n, args) for _ in range(args.repeat)),
            key=lambda r: r["wall_s"],
        )
        result = runs[(len(runs) - 1) // 2]  # the median run (the lower one of an even count)
        results[backend] = result
        wall = result["wall_s"]
        rows.append(
            {
                "model": bc.model_label(name),
                "backend": backend,
                "dtype": dtype,
                "requests": n,
                "prompt_tokens": prompt_tokens,
                "output_tokens": result["output_tokens"],
                "wall_s": wall,
                "output_tok_s": result["output_tokens"] / wall,
                "total_tok_s": (prompt_tokens + result["output_tokens"]) / wall,
                "matmul_gflop": work / 1e9,
                "matmul_gflop_s": work / wall / 1e9,
                "gemm_peak_gflop_s": gemm["peak"] / 1e9,
                "roofline_fraction": work / wall / gemm["peak"],
                "read_gb_s": read_gb_s,
                "floor_s": floor.serial_s,
                "floor_overlapped_s": floor.overlapped_s,
                "floor_fraction": floor.serial_s / wall,
                "threads": args.threads,
                "wall_s_runs": [r["wall_s"] for r in runs],
            }
        )
        spread = " / ".join(f"{r['wall_s']:.2f}" for r in runs)
        print(f"  {backend}: {wall:.2f} s (runs: {spread})", flush=True)
    base = next((r for r in rows if r["backend"] == "actorserve"), None)
    reference = results.get("hf-static") or results.get("hf-cb")
    for row in rows:
        if base and row["output_tok_s"] > 0:
            row["actorserve_speedup"] = base["output_tok_s"] / row["output_tok_s"]
        if reference is not None and args.temperature == 0:
            mine = results[row["backend"]]["tokens"]
            same = sum(a == b for a, b in zip(mine, reference["tokens"]))
            row["greedy_match"] = same / len(workload)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_throughput", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        nargs="+",
        default=list(bc.CHECKPOINT_KINDS),
        help=f"checkpoint kinds ({', '.join(bc.CHECKPOINT_KINDS)}) or directories "
        "(default: all three)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_REQUESTS.items()),
    )
    parser.add_argument(
        "--dtypes",
        default="auto,float32",
        help="comma-separated: auto (the checkpoint's own), float32, bfloat16",
    )
    bc.add_workload_flags(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--hf-cache",
        default="dynamic",
        choices=["dynamic", "static"],
        help="KV cache of hf-static's generate (default: transformers' default, dynamic)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="plan each step only after the last one (default: overlap planning with the step)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each backend (each in a fresh process); the table shows the median",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    bc.add_common_flags(parser)
    parser.add_argument(CHILD_FLAG, dest="child_result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.threads = args.threads or bc.default_threads()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if set(args.dtypes) - {"auto", *VALUE_BYTES}:
        parser.error(f"--dtypes: known are auto, {', '.join(VALUE_BYTES)}")
    if args.child_result:  # one backend, one model, in this (fresh) process
        model_dir = bc.resolve_model(args.model[0])
        shape = bc.ModelShape.read(model_dir)
        # the parent and each child build the same workload from the flags
        workload = bc.workload_from_flags(args, args.num_requests, shape.vocab)
        args.dtype = dtypes_for(shape, args.dtypes)[0]
        result = RUNNERS[args.backends.split(",")[0]](model_dir, workload, args)
        Path(args.child_result).write_text(json.dumps(result))
        return 0
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        parser.error(f"--backends: unknown {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    machine = bc.machine_line(args.threads)
    rows = []
    for name in args.model:
        rows.extend(bench_model(name, args))
    notes = [
        "",
        f"Machine: {machine}; load after the run {bc.load_average():.2f}.",
        f"Workload: nano-vllm style, seed {args.seed}, {bc.workload_lengths(args)}, "
        f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}; "
        "wall time from submitting the first request to the last token (start-up and warm-up "
        "excluded).",
        "output tok/s counts each request's own requested output tokens; hf-static generates up "
        "to its batch's longest output for every row, the rest is padding and not counted.",
        "matmul GFLOP = 2 x decoder-layer params x (prompt tokens + output tokens - 1 per "
        "request) + 2 x lm_head params x output tokens (attention and embedding left out); "
        "roofline = the best torch.mm FLOP/s at the row's dtype on the model's shapes, measured "
        "in the run.",
        "floor / wall = the floor's time at the row's dtype (floor.Floor: matmul work at that "
        "peak, weights and K/V at the memory read speed measured in the run, K/V after the "
        "GEMMs) / the row's wall time: the share of the best any engine at that dtype can do.",
        "actorserve x = actorserve's output tok/s / the row's at the same dtype; same tokens = "
        "requests whose greedy tokens equal the reference's (hf-static's, else hf-cb's) at the "
        "same dtype (bf16 tokens may part where two logits are within rounding).",
    ]
    print()
    print(bc.format_table(rows, COLUMNS, notes=notes))
    bc.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
