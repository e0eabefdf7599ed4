"""Part c of scripts/gpu_check.py: decode steps through the Worker's own ModelRunner, with no
other actor around (scripts/bench_step.py's approach), at each batch x context, with CUDA graphs
and without (`enforce_eager`), against the step's HBM floor.

Per (graphs, batch, context): the mean wall time of a decode step of `batch` requests whose
contexts start at `context` tokens, tokens/s, and from a few more steps under torch.profiler:
kernels run and launch calls made per step, host time per step (the profiled steps' wall time
less the time the host sat in a synchronizing CUDA call: what the CPU spends, profiler overhead
included) and the device's busy and idle time per step. The floor: the weights of the
projections and LM head plus the step's K/V, read once at the measured copy bandwidth.
"""

from __future__ import annotations

import gc
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import bench_common as bc
from bench_step import prefill
from kernel_variants import compiled_variants

LAUNCH_CALLS = {
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch",
}  # fmt: skip
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}
DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass(frozen=True)
class SweepSizes:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    warmup: int  # untimed decode steps before each point
    steps: int  # timed decode steps
    profiled: int  # steps under the profiler


CUDA_SIZES = SweepSizes((1, 8, 32, 64, 128, 256), (512, 1024, 2048), 3, 10, 2)
DRY_SIZES = SweepSizes((1, 2), (32, 64), 1, 2, 1)


def trace_summary(trace: dict, steps: int, wall_s: float) -> dict:
    """Per step, from a chrome trace of `steps` steps that took `wall_s`: kernels run, launch
    calls (graph launches among them), host ms (wall less synchronizing calls) and the device's
    busy ms (the union of its kernels, copies and sets) and idle ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    for event in events:
        event["cat"] = str(event.get("cat", "")).lower()
    runtime = [e for e in events if e["cat"] in ("cuda_runtime", "cuda_driver")]
    device = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e["cat"] in DEVICE_WORK
    )
    busy_us, end = 0.0, -math.inf
    for start, stop in device:  # the union of the intervals
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    sync_us = sum(float(e.get("dur", 0)) for e in runtime if "Synchronize" in e["name"])
    launches = [e for e in runtime if e["name"] in LAUNCH_CALLS]
    wall_ms = wall_s * 1e3 / steps
    busy_ms = busy_us / 1e3 / steps
    return {
        "kernels_per_step": sum(e["cat"] == "kernel" for e in events) / steps,
        "launch_calls_per_step": len(launches) / steps,
        "graph_launches_per_step": sum(e["name"] in GRAPH_LAUNCHES for e in launches) / steps,
        "host_ms": max(0.0, wall_ms - sync_us / 1e3 / steps),
        "gpu_busy_ms": busy_ms,
        "gpu_idle_ms": max(0.0, wall_ms - busy_ms) if device else None,
    }


def build(model_dir: Path, device: str, enforce_eager: bool, sizes: SweepSizes):
    """The Worker's runner with a cache that holds max(batches) requests of the longest context
    and every decode step of the sweep -> (runner, blocks per request)."""
    import msgspec

    from actorserve.actors.runtime.config import EngineConfig
    from actorserve.actors.runtime.config_resolution import resolve_model
    from actorserve.actors.worker.worker import build_runner

    config = resolve_model(EngineConfig(
        model=str(model_dir), device=device, enforce_eager=enforce_eager,
        max_num_seqs=max(sizes.batches),
    ))  # fmt: skip
    steps = len(sizes.batches) * (sizes.warmup + sizes.steps + sizes.profiled)
    per_request = math.ceil((max(sizes.contexts) + steps + 1) / config.block_size)
    config = msgspec.structs.replace(
        config, num_kv_blocks=per_request * max(sizes.batches), num_cpu_blocks=0
    )
    return build_runner(config), per_request


def decode(runner, rids: list[str], count: int, step_id: int) -> int:
    from actorserve.messages.step import RunningUpdate, StepPlan

    for _ in range(count):
        step_id += 1
        runner.execute(StepPlan(0, step_id, [], [RunningUpdate(rid, [], 1) for rid in rids], []))
    return step_id


def profiled_steps(runner, rids: list[str], count: int, step_id: int) -> tuple[dict, int]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step_id = decode(runner, rids, count, step_id)
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return trace_summary(trace, count, wall), step_id


def sweep_one_runner(runner, per_request, shape, sizes, bandwidth, graphs, deadline) -> list[dict]:
    """Every context (prefilled once for max(batches) requests), every batch over its first
    requests; stops at `deadline` (time.monotonic)."""
    import torch

    rows, step_id = [], 100_000
    vocab = shape.vocab
    kv_token_bytes = sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in runner.kv.layers)
    weight_bytes = runner.model.lm_head_weight().element_size() * (
        shape.layer_matmul_params + shape.lm_head_params
    )
    rng = random.Random(0)
    with torch.inference_mode():
        for context in sizes.contexts:
            runner.forget_all()
            num = max(sizes.batches)
            prompts = [[rng.randrange(5, vocab) for _ in range(context)] for _ in range(num)]
            budget = max(context, runner.config.max_num_batched_tokens)
            rids = prefill(runner, prompts, [per_request] * num, budget)
            for batch in sizes.batches:
                if time.monotonic() > deadline:
                    rows.append({"graphs": graphs, "context": context, "skipped": "budget"})
                    return rows
                some = rids[:batch]
                step_id = decode(runner, some, sizes.warmup, step_id)
                contexts = [len(runner.requests[r].token_ids) for r in some]
                start = time.perf_counter()
                step_id = decode(runner, some, sizes.steps, step_id)
                step_s = (time.perf_counter() - start) / sizes.steps
                profile, step_id = profiled_steps(runner, some, sizes.profiled, step_id)
                kv_bytes = (sum(contexts) + batch * sizes.steps / 2) * kv_token_bytes
                floor_s = (weight_bytes + kv_bytes) / bandwidth
                rows.append({
                    "graphs": graphs, "batch": batch, "context": context,
                    "mean_context": sum(contexts) / batch + sizes.steps / 2,
                    "step_ms": step_s * 1e3, "tokens_s": batch / step_s, **profile,
                    "weights_mb": weight_bytes / 1e6, "kv_mb": kv_bytes / 1e6,
                    "floor_ms": floor_s * 1e3, "x_floor": step_s / floor_s,
                })  # fmt: skip
    return rows


def run(model_dir: Path, device: str, sizes: SweepSizes, bandwidth: float, deadline: float):
    """Part c -> {"rows": [...], "compiled_variants": {...}, "goal": {...}}."""
    import torch

    shape = bc.ModelShape.read(model_dir)
    rows, builds = [], {}
    for graphs in (True, False):
        if time.monotonic() > deadline:
            rows.append({"graphs": graphs, "skipped": "budget"})
            continue
        start = time.perf_counter()
        runner, per_request = build(model_dir, device, not graphs, sizes)
        builds["graphs" if graphs else "eager"] = {
            "build_s": time.perf_counter() - start,
            "num_kv_blocks": runner.kv.num_blocks,
            "max_num_seqs": runner.config.max_num_seqs,
        }
        try:
            rows += sweep_one_runner(runner, per_request, shape, sizes, bandwidth, graphs, deadline)
        finally:
            runner.grammars.close()
            del runner
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print_rows(rows)
    return {
        "rows": rows,
        "builds": builds,
        "compiled_variants": compiled_variants(),
        "goal": goal(rows),
    }


def goal(rows: list[dict]) -> dict:
    """The issue's goals at batch 256, context 1024 with graphs: x_floor <= 1.3, host <= 0.2 ms."""
    point = [
        r for r in rows if r.get("graphs") and (r.get("batch"), r.get("context")) == (256, 1024)
    ]
    if not point:
        return {"measured": False}
    (row,) = point
    return {
        "measured": True,
        "x_floor": row["x_floor"],
        "x_floor_met": row["x_floor"] <= 1.3,
        "host_ms": row["host_ms"],
        "host_met": row["host_ms"] <= 0.2,
    }


def print_rows(rows: list[dict]) -> None:
    columns = [
        bc.Column("graphs", "graphs"), bc.Column("batch", "batch"),
        bc.Column("context", "context"), bc.Column("step_ms", "step ms", "{:.3f}"),
        bc.Column("tokens_s", "tok/s", "{:.0f}"), bc.Column("host_ms", "host ms", "{:.3f}"),
        bc.Column("gpu_idle_ms", "idle ms", "{:.3f}"),
        bc.Column("kernels_per_step", "kernels", "{:.0f}"),
        bc.Column("launch_calls_per_step", "launches", "{:.0f}"),
        bc.Column("floor_ms", "floor ms", "{:.3f}"), bc.Column("x_floor", "x floor", "{:.2f}"),
    ]  # fmt: skip
    timed = [r for r in rows if "step_ms" in r]
    print(bc.format_table(timed, columns, "decode sweep (the Worker's runner alone)"), flush=True)
