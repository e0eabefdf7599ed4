"""The benchmark scripts run end to end on a tiny checkpoint and write the tables they print."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_common as bc  # noqa: E402
from floor import decode_steps, engine_floor, matmul_flops  # noqa: E402

SHAPE = bc.ModelShape(
    hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=50
)


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
        "decode attention", "lm_head + greedy argmax (as served)", "GEMM qkv_proj", "GEMM o_proj",
        "GEMM gate_up_proj", "GEMM down_proj", "RMSNorm (+ residual)", "q/k norm + RoPE",
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
    # each is compared with the step's memory floor: the fp32 weights and K/V read once
    shape = bc.ModelShape.read(llama_dir)
    weights_mb = 4 * (shape.layer_matmul_params + shape.lm_head_params) / 1e6
    for r in served.values():
        floor_ms = (weights_mb + kv["kv_mb_per_step"]) / (kv["streaming_read_gb_s"] * 1e3) * 1e3
        assert r["floor_ms"] == pytest.approx(floor_ms, rel=1e-3)
        assert r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
    heads = {r["way"]: r for r in rows if r["table"] == "head"}  # each gave the same tokens
    exact = {"fused fp32 (cpu_panel_gemm.c)", "GEMM + argmax_rows"}
    int8 = "int8 screen + exact fp32 (screened_head_int8.py)"  # where the CPU has AMX
    bf16 = "bf16 screen + exact fp32 (screened_head.py)"  # where it has bf16 arithmetic
    assert set(heads) in (exact, exact | {bf16}, exact | {int8, bf16})
    assert all(r["ms"] > 0 and r["rows"] == 4 for r in heads.values())


def test_bench_step_with_int8_counts_a_byte_a_projection_weight_in_its_floor(llama_dir, tmp_path):
    rows = run_script(
        "bench_step.py", "--model", str(llama_dir), "--num-requests", "2", "--max-prompt-len",
        "20", "--steps", "2", "--warmup", "1", "--quantization", "int8",
        json_path=tmp_path / "step.json",
    )  # fmt: skip
    (kv,) = [r for r in rows if r["table"] == "kv"]
    shape = bc.ModelShape.read(llama_dir)
    weights_mb = (shape.layer_matmul_params + 4 * shape.lm_head_params) / 1e6  # fp32 head
    for r in (r for r in rows if r["table"] == "served"):
        floor_ms = (weights_mb + kv["kv_mb_per_step"]) / (kv["streaming_read_gb_s"] * 1e3) * 1e3
        assert r["floor_ms"] == pytest.approx(floor_ms, rel=1e-3)


def test_bench_overhead_measures_the_ipc_round_trips_against_the_os_floor(tmp_path):
    rows = run_script(
        "bench_overhead.py", "--skip-steps", "--num-requests", "8", "--ipc-iterations", "50",
        json_path=tmp_path / "ipc.json",
    )  # fmt: skip
    modes = {r["mode"] for r in rows}
    assert modes == {"engine", "asyncio", "blocking", "socketpair"}
    assert all(r["p50_us"] > 0 and r["iterations"] == 50 for r in rows)
    one_cpu = {r["mode"] for r in rows if r["one_cpu"]}
    assert one_cpu == {"engine", "socketpair"}  # the same round trips without a CPU to wake


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


def test_the_fp32_floor_with_free_memory_reads_is_the_matmul_work_at_the_peak():
    workload = bc.make_workload(5, seed=1, prompt_len=(3, 9), output_len=(1, 6), vocab_size=50)
    floor = engine_floor(SHAPE, workload, peak_flop_s=1e6, read_bytes_s=math.inf)
    assert floor.kv_s == 0
    assert floor.serial_s == pytest.approx(matmul_flops(SHAPE, workload) / 1e6)
    assert floor.overlapped_s == pytest.approx(floor.serial_s)


def test_the_fp32_floor_of_one_request_reads_the_weights_and_its_kv_at_every_decode_step():
    request = bc.Request(prompt_ids=[7] * 10, output_len=3)  # 2 decode steps: contexts 11, 12
    weights = 4 * (SHAPE.layer_matmul_params + SHAPE.lm_head_params)
    kv_per_token = 2 * 2 * 1 * 4 * 4  # layers x (K, V) x kv heads x head_dim x fp32
    assert SHAPE.kv_values_per_token * 4 == kv_per_token
    floor = engine_floor(SHAPE, [request], peak_flop_s=math.inf, read_bytes_s=1e3)
    assert floor.prefill_s == 0
    assert floor.gemm_s == pytest.approx(2 * weights / 1e3)
    assert floor.kv_s == pytest.approx(kv_per_token * (11 + 12) / 1e3)
    assert floor.serial_s == pytest.approx(floor.gemm_s + floor.kv_s)
    assert floor.overlapped_s == pytest.approx(floor.gemm_s + floor.kv_s)  # both bytes: no FLOPs


def test_a_bf16_floor_reads_half_the_bytes_of_the_fp32_one():
    request = bc.Request(prompt_ids=[7] * 10, output_len=3)
    fp32 = engine_floor(SHAPE, [request], peak_flop_s=math.inf, read_bytes_s=1e3)
    bf16 = engine_floor(SHAPE, [request], math.inf, 1e3, weight_value_bytes=2, kv_value_bytes=2)
    assert bf16.gemm_s == pytest.approx(fp32.gemm_s / 2)
    assert bf16.kv_s == pytest.approx(fp32.kv_s / 2)


def test_decode_steps_run_every_request_at_once_or_as_many_as_are_in_flight():
    short, long, last = (bc.Request([7] * p, n) for p, n in ((10, 3), (20, 5), (30, 2)))
    # all at once: step k decodes every request still short of its output (prefill made token 1)
    assert decode_steps([short, long, last]) == [[11, 21, 31], [12, 22], [23], [24]]
    # two in flight: the third starts in the slot the short one frees after its 2 decode steps
    assert decode_steps([short, long, last], concurrency=2) == [[11, 21], [12, 22], [23, 31], [24]]
    # one at a time: each request's steps after the one before
    assert decode_steps([short, long], concurrency=1) == [[11], [12], [21], [22], [23], [24]]


def test_a_floor_one_request_at_a_time_reads_the_weights_at_every_step_of_every_request():
    requests = [bc.Request([7] * 10, 3), bc.Request([7] * 10, 3)]
    weights = 4 * (SHAPE.layer_matmul_params + SHAPE.lm_head_params)
    together = engine_floor(SHAPE, requests, peak_flop_s=math.inf, read_bytes_s=1e3)
    alone = engine_floor(SHAPE, requests, math.inf, 1e3, concurrency=1)
    assert together.gemm_s == pytest.approx(2 * weights / 1e3)
    assert alone.gemm_s == pytest.approx(4 * weights / 1e3)
    assert alone.kv_s == pytest.approx(together.kv_s)  # the same contexts, read in other steps


def test_bench_throughput_runs_auto_as_the_checkpoints_own_dtype_and_each_dtype_once():
    import bench_throughput

    bf16 = bc.ModelShape(8, 16, 2, 2, 1, 4, 50, dtype="bfloat16")
    assert bench_throughput.dtypes_for(bf16, ["auto", "float32"]) == ["bfloat16", "float32"]
    assert bench_throughput.dtypes_for(SHAPE, ["auto", "float32"]) == ["float32"]


@pytest.mark.slow
def test_bench_throughput_runs_all_three_engines_on_one_workload_with_the_same_tokens(
    llama_dir, tmp_path
):
    rows = run_script(
        "bench_throughput.py", "--model", str(llama_dir), "--num-requests", "4",
        "--max-prompt-len", "40", "--min-output-len", "4", "--max-output-len", "12", "--quiet",
        json_path=tmp_path / "t.json",
    )  # fmt: skip
    by_backend = {r["backend"]: r for r in rows}
    assert set(by_backend) == {"actorserve", "hf-static", "hf-cb"}
    workload = bc.make_workload(4, 0, (16, 40), (4, 12), bc.ModelShape.read(llama_dir).vocab)
    assert all(r["output_tokens"] == sum(w.output_len for w in workload) for r in rows)
    assert all(r["greedy_match"] == 1.0 for r in rows)
    assert by_backend["actorserve"]["actorserve_speedup"] == 1.0
    for row in rows:
        assert row["actorserve_speedup"] == pytest.approx(
            by_backend["actorserve"]["output_tok_s"] / row["output_tok_s"]
        )
        assert 0 < row["floor_s"] and row["floor_overlapped_s"] <= row["floor_s"]
        assert row["floor_fraction"] == pytest.approx(row["floor_s"] / row["wall_s"])


@pytest.mark.slow
def test_actorserve_bench_serving_loads_both_doors_at_a_rate_and_a_concurrency(llama_dir, tmp_path):
    plot, table = tmp_path / "serving.png", tmp_path / "serving.json"
    command = [
        sys.executable, "-m", "actorserve.cli", "bench", "serving", "--model", str(llama_dir),
        "--rates", "4", "--concurrency", "2", "--num-requests", "4", "--min-prompt-len", "8",
        "--max-prompt-len", "40", "--min-output-len", "4", "--max-output-len", "8",
        "--plot", str(plot), "--json", str(table),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(table.read_text())
    assert {(r["mode"], r["load"]) for r in rows} == {
        (door, load) for door in ("sdk", "gateway") for load in ("rate 4/s", "concurrency 2")
    }
    for row in rows:
        assert row["requests"] == 4 and row["failed"] == 0
        assert 0 < row["ttft_p50_ms"] <= row["e2e_p50_ms"] and row["tpot_p50_ms"] > 0
        assert row["output_throughput"] * row["duration_s"] >= 4 * 4  # every request's tokens
    assert plot.read_bytes().startswith(b"\x89PNG")
