"""The benchmark scripts run end to end on a tiny checkpoint and write the tables they print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(name: str, *args: str, json_path: Path) -> list[dict]:
    command = [sys.executable, str(SCRIPTS / name), *args, "--json", str(json_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(json_path.read_text())


def test_bench_step_times_every_op_once_and_within_the_step(llama_dir, tmp_path):
    rows = run_script(
        "bench_step.py", "--model", str(llama_dir), "--num-requests", "4", "--max-prompt-len",
        "40", "--steps", "3", "--warmup", "1", json_path=tmp_path / "step.json",
    )  # fmt: skip
    ops = {r["op"]: r for r in rows if r["table"] == "step"}
    timed = [
        "decode attention", "lm_head + greedy argmax (fused)", "GEMM qkv_proj", "GEMM o_proj",
        "GEMM gate_up_proj", "GEMM down_proj", "RMSNorm (+ residual)", "RoPE (q and k)",
        "SiLU x up", "store_kv", "input preparation",
    ]  # fmt: skip
    assert all(ops[op]["ms"] > 0 for op in timed)
    assert "sampling" not in ops  # greedy rows: the fused head picked every token
    # no op is timed inside another (the timed ops fit in the step, leaving a rest >= 0)
    assert 0 <= ops["rest (embedding, Python between ops)"]["ms"] < ops["step (4 decodes)"]["ms"]
    (kv,) = [r for r in rows if r["table"] == "kv"]
    assert kv["kv_mb_per_step"] > 0 and kv["attention_gb_s"] > 0
    served = {r["way"]: r for r in rows if r["table"] == "served"}
    assert set(served) == {"layer by layer", "decode stack (one C call, served)"}
    assert all(r["ms"] > 0 for r in served.values())
    heads = {r["way"]: r for r in rows if r["table"] == "head"}
    assert set(heads) == {"fused (cpu_panel_gemm.c)", "GEMM + argmax_rows"}
    assert all(r["ms"] > 0 and r["rows"] == 4 for r in heads.values())


def test_bench_overhead_measures_the_ipc_round_trips_against_the_os_floor(tmp_path):
    rows = run_script(
        "bench_overhead.py", "--skip-steps", "--num-requests", "8", "--ipc-iterations", "50",
        json_path=tmp_path / "ipc.json",
    )  # fmt: skip
    modes = {r["mode"] for r in rows}
    assert modes == {"asyncio", "blocking", "socketpair"}
    assert all(r["p50_us"] > 0 and r["iterations"] == 50 for r in rows)
    one_cpu = {r["mode"] for r in rows if r["one_cpu"]}
    assert one_cpu == {"asyncio", "socketpair"}  # the same round trips without a CPU to wake


def test_bench_overhead_splits_the_step_and_the_wait_between_steps_hop_by_hop(llama_dir, tmp_path):
    rows = run_script(
        "bench_overhead.py", "--model", str(llama_dir), "--skip-ipc", "--num-requests", "4",
        "--output-len", "24", "--max-prompt-len", "40", "--repeat", "2", "--quiet",
        json_path=tmp_path / "o.json",
    )  # fmt: skip
    step = {r["phase"]: r for r in rows if r["table"] == "step"}
    non_model = step["non-model (all but the two model rows)"]
    assert len(non_model["runs"]) == 2 and non_model["share"] in non_model["runs"]
    assert step["decoder forward"]["mean_ms"] > 0
    assert step["lm_head (sampling rows; greedy: argmax fused in)"]["mean_ms"] > 0
    assert 0 < step["non-model (all but the two model rows)"]["share"] < 1
    assert {r["process"] for r in rows if r["table"] == "cpu"} >= {"worker", "scheduler", "engine"}
    hops = {r["hop"]: r for r in rows if r["table"] == "control"}
    wait = hops.pop("the Worker waits between two steps (all of the above)")
    period = hops.pop("step period")
    blocks = hops.pop("BlockManager round trip (AllocateStep -> Allocation)")
    assert len(hops) == 3
    # each hop is timed in the order the messages go (a mark out of order makes one negative)
    assert all(hop["p50_us"] > 0 and hop["mean_us"] > 0 for hop in hops.values())
    assert 0 < wait["mean_us"] < period["mean_us"]
    # most decode steps fit in the blocks their requests hold: no round trip (0 us)
    assert blocks["p50_us"] == 0 and 0 < blocks["block_round_trips"] < blocks["steps"] / 2
