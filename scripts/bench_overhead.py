"""Overhead: per step, the model's time against everything else; and the message round trip.

    python scripts/bench_overhead.py [--model demo] [--num-requests 64] [--json PATH]

1. Step breakdown, on the real actor processes: the offline API runs `--num-requests` requests
   (random-token prompts of 16-512 tokens, `--output-len` tokens each, ignore_eos) with the
   Worker tracing its steps (EngineConfig.step_trace, actors/runtime/step_trace.py). Over the decode
   steps that run all `--num-requests` requests, each step's period (one step start to the next)
   is split into: decoder forward and lm_head (the model; with every row greedy, the LM head
   picks the tokens itself, kernels/cpu/csrc/cpu_panel_gemm.c, so the argmax is in that row), input
   preparation (applying the StepPlan to the persistent batch, flat inputs), sampling and
   bookkeeping, and the time outside the Worker's step (StepResult out, the Scheduler's stop
   checks and TokensOut, the next plan, the BlockManager round trip, StepPlan in: scheduling,
   block allocation, messages). The run is made `--repeat` times (default 3): a shared or
   virtual machine's speed drifts between runs, so the table is the run of median non-model
   share, and every run's share is printed with it.
   Then the same run again without async scheduling, where the Worker waits for every hop of
   the control loop between two steps, split hop by hop from the Worker's and the Scheduler's
   traces: StepResult message, the Scheduler (stop checks, outputs, the next StepPlan), the
   BlockManager round trip (only steps that need blocks have one), the StepPlan message (with
   async scheduling these overlap the forward and cost CPU on the same cores instead of waiting).
2. Message round trip over ipc:// (scripts/ipc_round_trip.py): a StepPlan of N requests out, the
   StepResult of N tokens back, with the two ends paired as in the engine (the Scheduler's
   LoopSocket, the Worker's forward thread), both on LoopSocket, and both on blocking zmq; the
   operating system's floor (a socketpair ping-pong); the same on one CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import ipc_round_trip  # noqa: E402

# -- 1. step breakdown ------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line]


def trace_steps(model_dir: Path, args, async_scheduling: bool = True):
    """One offline run with the actors tracing their steps -> (the Worker's step records, the
    Scheduler's step events, CPU rows by process)."""
    from actorserve import LLM, SamplingParams

    vocab = bc.ModelShape.read(model_dir).vocab
    workload = bc.make_workload(
        args.num_requests, args.seed, (16, args.max_prompt_len), (args.output_len,) * 2, vocab
    )
    with tempfile.TemporaryDirectory(prefix="actorserve-bench-") as tmp:
        trace = Path(tmp) / "steps.jsonl"
        settings = dict(
            torch_threads=args.threads,
            max_num_seqs=args.num_requests,
            async_scheduling=async_scheduling,
            step_trace=str(trace),
        )
        with LLM(str(model_dir), **settings) as llm:
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            before, start = bc.process_cpu_seconds(), time.perf_counter()
            llm.generate([r.prompt_ids for r in workload], params, use_tqdm=not args.quiet)
            after, wall = bc.process_cpu_seconds(), time.perf_counter() - start
        steps = read_jsonl(trace)
        events = read_jsonl(trace.with_name(trace.name + ".scheduler"))
    cpu = [
        {
            "table": "cpu",
            "process": name,
            "cpu_s": after[name] - before.get(name, 0.0),
            "cores": (after[name] - before.get(name, 0.0)) / wall,
            "wall_s": wall,
        }
        for name in sorted(after, key=lambda n: -(after[n] - before.get(n, 0.0)))
    ]
    return steps, events, cpu


def full_decode_steps(steps: list[dict], batch: int) -> list[tuple[dict, dict]]:
    """(step, the step after it) for each step that decodes `batch` requests and nothing else."""
    pairs = [
        (step, following)
        for step, following in zip(steps, steps[1:])
        if step["seqs"] == batch and step["tokens"] == batch and following["step"] > step["step"]
    ]
    if not pairs:
        raise SystemExit(f"no decode step ran {batch} requests; raise --output-len")
    return pairs


LM_HEAD = "lm_head (sampling rows; greedy: argmax fused in)"


NON_MODEL = "non-model (all but the two model rows)"


def step_breakdown(steps: list[dict], batch: int) -> list[dict]:
    """Rows of phase -> mean and p50 ms per step, share of the step, over full decode steps."""
    periods = [(s, n["start"] - s["start"]) for s, n in full_decode_steps(steps, batch)]
    phases = {
        "decoder forward": lambda s, p: s["forwarded"] - s["prepared"],
        LM_HEAD: lambda s, p: s["logits"] - s["forwarded"],
        "input preparation (plan -> flat inputs)": lambda s, p: s["prepared"] - s["start"],
        "sampling + bookkeeping": lambda s, p: s["end"] - s["logits"],
        "outside the worker step (scheduler, blocks, messages)": lambda s, p: (
            p - (s["end"] - s["start"])
        ),
    }
    total = statistics.fmean(p for _, p in periods)
    rows = []
    for name, f in phases.items():
        values = [f(s, p) for s, p in periods]
        mean = statistics.fmean(values)
        rows.append(
            {
                "table": "step",
                "phase": name,
                "model": name in ("decoder forward", LM_HEAD),
                "mean_ms": mean * 1e3,
                "p50_ms": bc.percentile(values, 50) * 1e3,
                "share": mean / total,
                "steps": len(periods),
            }
        )
    model = sum(r["mean_ms"] for r in rows if r["model"])
    rows.append(
        {
            "table": "step",
            "phase": NON_MODEL,
            "mean_ms": total * 1e3 - model,
            "p50_ms": None,
            "share": 1 - model / (total * 1e3),
            "steps": len(periods),
        }
    )
    rows.append(
        {
            "table": "step",
            "phase": f"step period ({batch} decodes)",
            "mean_ms": total * 1e3,
            "p50_ms": bc.percentile([p for _, p in periods], 50) * 1e3,
            "share": 1.0,
            "steps": len(periods),
        }
    )
    return rows


def median_run(model_dir: Path, args) -> tuple[list[dict], list[dict]]:
    """`args.repeat` traced runs -> the step rows and CPU rows of the run whose non-model share
    is the median; its non-model row also holds every run's share ("runs", in run order). The
    machine's speed drifts between runs (a VM); the median run is the table, the spread is
    printed with it."""
    runs = []
    for _ in range(max(1, args.repeat)):
        steps, _, cpu_rows = trace_steps(model_dir, args)
        runs.append((step_breakdown(steps, args.num_requests), cpu_rows))
    shares = [non_model_share(step_rows) for step_rows, _ in runs]
    by_share = sorted(range(len(runs)), key=lambda i: shares[i])
    step_rows, cpu_rows = runs[by_share[len(runs) // 2]]
    non_model_row(step_rows)["runs"] = shares
    return step_rows, cpu_rows


def non_model_share(step_rows: list[dict]) -> float:
    return non_model_row(step_rows)["share"]


def non_model_row(step_rows: list[dict]) -> dict:
    return next(r for r in step_rows if r["phase"] == NON_MODEL)


def control_loop_breakdown(steps: list[dict], events: list[dict], batch: int) -> list[dict]:
    """Rows of hop -> p50 and mean us from one full decode step's end to the next one's start,
    from the Worker's and the Scheduler's traces of a run without async scheduling (there each
    hop waits for the one before, and none overlaps the forward). A step planned within the
    blocks its requests hold has no BlockManager round trip (0 us in that row)."""
    at = {(e["step"], e["event"]): e["t"] for e in events}

    def t(step: dict, event: str) -> float:
        return at[(step["step"], event)]

    def block_manager(n: dict) -> float:
        asked = (n["step"], "allocate_out") in at
        return t(n, "allocation_in") - t(n, "allocate_out") if asked else 0.0

    hops = {
        "StepResult message (Worker -> Scheduler)": lambda s, n: t(s, "result_in") - s["end"],
        "Scheduler: stop checks, outputs, the next StepPlan": lambda s, n: (
            t(n, "plan_out") - t(s, "result_in") - block_manager(n)
        ),
        "BlockManager round trip (AllocateStep -> Allocation)": lambda s, n: block_manager(n),
        "StepPlan message (Scheduler -> the Worker's forward)": lambda s, n: (
            n["start"] - t(n, "plan_out")
        ),
        "the Worker waits between two steps (all of the above)": lambda s, n: n["start"] - s["end"],
        "step period": lambda s, n: n["start"] - s["start"],
    }
    pairs = [
        (s, n)
        for s, n in full_decode_steps(steps, batch)
        if (s["step"], "result_in") in at and (n["step"], "plan_out") in at
    ]
    if not pairs:
        raise SystemExit("the Scheduler's trace has no full decode step")
    asked = sum((n["step"], "allocate_out") in at for _, n in pairs)
    rows = []
    for name, f in hops.items():
        values = [f(s, n) for s, n in pairs]
        rows.append(
            {
                "table": "control",
                "hop": name,
                "p50_us": bc.percentile(values, 50) * 1e6,
                "mean_us": statistics.fmean(values) * 1e6,
                "steps": len(pairs),
                "block_round_trips": asked,
            }
        )
    return rows


STEP_COLUMNS = [
    bc.Column("phase", "phase"),
    bc.Column("mean_ms", "mean ms/step", "{:.2f}"),
    bc.Column("p50_ms", "p50 ms", "{:.2f}"),
    bc.Column("share", "share of step", "{:.1%}"),
]
CONTROL_COLUMNS = [
    bc.Column("hop", "hop"),
    bc.Column("p50_us", "p50 us", "{:.0f}"),
    bc.Column("mean_us", "mean us", "{:.0f}"),
]
CPU_COLUMNS = [
    bc.Column("process", "process"),
    bc.Column("cpu_s", "CPU s", "{:.2f}"),
    bc.Column("cores", "cores busy (CPU s / wall s)", "{:.2f}"),
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="bench_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="checkpoint kind or directory")
    parser.add_argument("--num-requests", type=int, default=64, help="the batch (default 64)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ipc-iterations", type=int, default=2000)
    parser.add_argument("--skip-steps", action="store_true", help="only the ipc round trip")
    parser.add_argument("--skip-ipc", action="store_true", help="only the step breakdown")
    parser.add_argument(
        "--skip-control-loop", action="store_true", help="no second run without async scheduling"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="step-breakdown runs; the table is the run of median non-model share (default 3)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    bc.add_common_flags(parser)
    args = parser.parse_args(argv)
    args.threads = args.threads or bc.default_threads()
    machine = bc.machine_line(args.threads)
    rows: list[dict] = []
    out = []
    if not args.skip_steps:
        model_dir = bc.resolve_model(args.model)
        step_rows, cpu_rows = median_run(model_dir, args)
        shares = non_model_row(step_rows)["runs"]
        for row in step_rows:
            row["model_name"] = bc.model_label(args.model)
        rows += step_rows
        runs = ", ".join(f"{share:.1%}" for share in shares)
        out.append(
            bc.format_table(
                step_rows,
                STEP_COLUMNS,
                title=f"Step time, {bc.model_label(args.model)}, {args.num_requests} running "
                f"requests decoding ({step_rows[0]['steps']} steps; of {len(shares)} runs, the "
                f"one of median non-model share; the runs: {runs}):",
            )
        )
        rows += cpu_rows
        out.append(
            bc.format_table(
                cpu_rows,
                CPU_COLUMNS,
                title=f"CPU time by process over the whole run ({cpu_rows[0]['wall_s']:.1f} s "
                f"wall; driver = this script: the offline API's client and the supervisor):",
            )
        )
    if not args.skip_steps and not args.skip_control_loop:
        steps, events, _ = trace_steps(model_dir, args, async_scheduling=False)
        control_rows = control_loop_breakdown(steps, events, args.num_requests)
        rows += control_rows
        out.append(
            bc.format_table(
                control_rows,
                CONTROL_COLUMNS,
                title=f"Between two steps, hop by hop: the same run without async scheduling, "
                f"so the Worker waits for each hop ({control_rows[0]['steps']} steps, "
                f"{control_rows[0]['block_round_trips']} of them asked the BlockManager):",
            )
        )
    if not args.skip_ipc:
        ipc_rows = ipc_round_trip.ipc_table(args.num_requests, args.ipc_iterations)
        rows += ipc_rows
        out.append(
            bc.format_table(
                ipc_rows,
                ipc_round_trip.COLUMNS,
                title=f"ipc:// round trip, StepPlan out and StepResult of {args.num_requests} "
                f"tokens back ({args.ipc_iterations} each; full plan = prompts of 256 tokens):",
            )
        )
    print()
    print("\n\n".join(out))
    print(f"\nMachine: {machine}; load after the run {bc.load_average():.2f}.")
    bc.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
