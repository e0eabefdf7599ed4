"""Tensor parallelism: one Worker against a group of ranks, on the same prompts.

    python scripts/bench_tensor_parallel.py [--model demo] [--sizes 1 2] [--num-requests 16]
        [--threads-per-rank 1] [--dtype float32] [--json PATH]

For each tensor_parallel_size in --sizes, the offline API (the real actor processes) runs the
same seeded workload (random-token prompts, outputs to their length, greedy, ignore_eos) with
the Worker tracing its steps (EngineConfig.step_trace), and the table says: output tokens/s
over the generate call, the mean step (rank 0's, from its plan to its StepResult) and the mean
all-reduce time per step (rank 0's TensorParallel.all_reduce_s, from its PATH.all_reduce trace:
actors/worker/step_handler.py). Every rank runs --threads-per-rank torch threads, so on a small
CPU machine TP=2 is a correctness run with the all-reduce cost made visible, not a speed-up.
On CUDA an all-reduce is queued on the stream and the time is its launch, not its transfer.
The greedy tokens of every size are compared with the first size's: the table says whether
they are the same. Every size runs the plain torch path (the CPU fast path off, as it is for
any group), so the sizes differ only by the sharding; in float32 (the default) the tokens are
expected equal, in bfloat16 the all-reduce's different order of sums may flip a near tie.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def run_size(model_dir: Path, size: int, workload, args) -> tuple[dict, list[list[int]]]:
    """One offline run with `size` ranks -> (its table row, the tokens of every request)."""
    from actorserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="actorserve-bench-tp-") as tmp:
        trace = Path(tmp) / "steps.jsonl"
        settings = dict(
            tensor_parallel_size=size,
            torch_threads=args.threads_per_rank,
            max_num_seqs=len(workload),
            step_trace=str(trace),
            dtype=args.dtype,
            cpu_fast_path=False,
        )
        if args.device:
            settings["device"] = args.device
        with LLM(str(model_dir), **settings) as llm:
            params = [
                SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                for r in workload
            ]
            start = time.perf_counter()
            outputs = llm.generate([r.prompt_ids for r in workload], params, use_tqdm=False)
            wall = time.perf_counter() - start
        steps = read_jsonl(trace)  # written as the Worker exits, when the LLM is closed
        all_reduce = read_jsonl(trace.with_name(trace.name + ".all_reduce"))
    tokens = [o.token_ids for o in outputs]
    row = {
        "table": "tensor_parallel",
        "tensor_parallel_size": size,
        "threads_per_rank": args.threads_per_rank,
        "output_tokens": sum(map(len, tokens)),
        "tokens_per_s": sum(map(len, tokens)) / wall,
        "steps": len(steps),
        "step_ms": statistics.fmean(s["end"] - s["start"] for s in steps) * 1e3 if steps else None,
        "all_reduce_ms": (
            statistics.fmean(r["all_reduce_s"] for r in all_reduce) * 1e3 if all_reduce else None
        ),
    }
    return row, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="checkpoint kind or directory")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--device", default=None, help="EngineConfig.device (default: auto)")
    parser.add_argument("--dtype", default="float32", help="EngineConfig.dtype")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the table here")
    bc.add_workload_flags(parser)
    args = parser.parse_args(argv)

    model_dir = bc.resolve_model(args.model)
    vocab = bc.ModelShape.read(model_dir).vocab
    workload = bc.workload_from_flags(args, args.num_requests, vocab)
    rows, first = [], None
    for size in args.sizes:
        row, tokens = run_size(model_dir, size, workload, args)
        first = tokens if first is None else first
        row["same_tokens"] = "yes" if tokens == first else "NO"
        rows.append(row)
    columns = [
        bc.Column("tensor_parallel_size", "TP"),
        bc.Column("threads_per_rank", "threads/rank"),
        bc.Column("output_tokens", "tokens"),
        bc.Column("tokens_per_s", "tokens/s", "{:.1f}"),
        bc.Column("steps", "steps"),
        bc.Column("step_ms", "step ms", "{:.2f}"),
        bc.Column("all_reduce_ms", "all-reduce ms/step", "{:.3f}"),
        bc.Column("same_tokens", f"tokens = TP {args.sizes[0]}'s"),
    ]
    notes = [
        f"{bc.model_label(args.model)} in {args.dtype}, {args.num_requests} requests: "
        f"{bc.workload_lengths(args)}",
        bc.machine_line(args.threads_per_rank),
    ]
    print(bc.format_table(rows, columns, "Tensor parallel", notes))
    bc.write_json(args.json, rows)
    return 0 if all(r["same_tokens"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
