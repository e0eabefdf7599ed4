"""The prepared GPU check (scripts/gpu_check.py) works before a GPU window is spent on it: its dry
run on the CPU writes every part's section, and the pieces that read a GPU run's output (profiler
traces, junit XML) and the workload it runs are right."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_check  # noqa: E402
import gpu_check_setup  # noqa: E402
from gpu_check_serving import nano_vllm_workload  # noqa: E402
from gpu_check_sweep import trace_summary  # noqa: E402


def event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_trace_gives_kernels_launches_host_and_device_time_per_step():
    """Two steps of 1 ms each: per step 3 kernels (two overlapping), 2 kernel launches and a
    graph launch, 0.25 ms blocked in a synchronize."""
    trace = {"traceEvents": []}
    for step in range(2):
        t = step * 1000.0
        trace["traceEvents"] += [
            event("cpu_op", "aten::mm", t, 50),
            event("cuda_runtime", "cudaLaunchKernel", t + 10, 5),
            event("cuda_driver", "cuLaunchKernel", t + 20, 5),
            event("cuda_runtime", "cudaGraphLaunch", t + 30, 5),
            event("cuda_runtime", "cudaStreamSynchronize", t + 700, 250),
            event("Kernel", "gemm", t + 100, 200),  # older traces capitalise the category
            event("kernel", "attention", t + 250, 100),  # overlaps gemm by 50 us
            event("kernel", "argmax", t + 500, 100),
            event("gpu_memcpy", "Memcpy DtoH", t + 650, 50),
        ]
    trace["traceEvents"].append({"ph": "i", "name": "marker", "ts": 0})  # not a span: ignored
    summary = trace_summary(trace, steps=2, wall_s=2e-3)
    assert summary["kernels_per_step"] == 3
    assert summary["launch_calls_per_step"] == 3
    assert summary["graph_launches_per_step"] == 1
    assert summary["host_ms"] == pytest.approx(1.0 - 0.25)
    assert summary["gpu_busy_ms"] == pytest.approx((250 + 100 + 50) / 1e3)
    assert summary["gpu_idle_ms"] == pytest.approx(1.0 - 0.4)


def test_a_cpu_trace_has_no_device_time():
    trace = {"traceEvents": [event("cpu_op", "aten::mm", 0, 500)]}
    summary = trace_summary(trace, steps=1, wall_s=1e-3)
    assert summary["kernels_per_step"] == summary["launch_calls_per_step"] == 0
    assert summary["host_ms"] == pytest.approx(1.0)
    assert summary["gpu_idle_ms"] is None


def test_the_junit_summary_counts_and_names_the_failures(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="1" skipped="0">'
        '<testcase classname="tests.test_kernels" name="test_ok"/>'
        '<testcase classname="tests.test_kernels" name="test_bad">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.test_model" name="test_err">'
        '<error message="CUDA error">trace</error></testcase>'
        "</testsuite></testsuites>"
    )
    summary = gpu_check.junit_summary(xml)
    assert (summary["tests"], summary["failures"], summary["errors"]) == (3, 1, 1)
    assert summary["failed"] == [
        {"test": "tests.test_kernels::test_bad", "message": "assert 1 == 2"},
        {"test": "tests.test_model::test_err", "message": "CUDA error"},
    ]


def test_the_workload_is_nano_vllms_bench():
    """bench.py there: seed(0); 256 prompts of randint(100, 1024) ids in 0..10000, then 256
    output lengths in 100..1024, in that order of draws."""
    prompts, outputs = nano_vllm_workload(256, (100, 1024))
    assert len(prompts) == len(outputs) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts)
    assert all(0 <= t <= 10000 for p in prompts for t in p)
    assert all(100 <= n <= 1024 for n in outputs)
    assert nano_vllm_workload(256, (100, 1024)) == (prompts, outputs)
    import random

    rng = random.Random(0)
    assert len(prompts[0]) == rng.randint(100, 1024)


def test_the_gpu_tests_collected_are_the_gpu_marked_modules():
    files = gpu_check.gpu_test_files()
    assert "tests/test_gpu_sizing.py" in files and "tests/test_kernels.py" in files
    assert "tests/test_gpu_check.py" not in files  # holds no gpu-marked test


def test_every_module_the_gpu_machine_lacks_has_its_wheel_listed():
    """scripts/gpu_wheels.sh downloads a wheel for each of gpu_check_setup.NEEDED_MODULES (by
    the distribution that provides the module here)."""
    script = (SCRIPTS / "gpu_wheels.sh").read_text()
    names = re.search(r"NAMES=\(([^)]*)\)", script).group(1).split()
    listed = {n.lower().replace("_", "-") for n in names}
    providers = importlib.metadata.packages_distributions()
    for module in gpu_check_setup.NEEDED_MODULES:
        dists = {d.lower().replace("_", "-") for d in providers[module]}
        assert dists & listed, f"{module}: none of {dists} in gpu_wheels.sh"


@pytest.mark.slow
def test_a_dry_run_writes_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, str(SCRIPTS / "gpu_check.py"), "--dry-run", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    parts = result["parts"]
    assert list(parts) == ["setup", *gpu_check.PARTS]
    failed = {name: p.get("error") for name, p in parts.items() if p["status"] != "ok"}
    assert not failed
    assert parts["setup"]["copy_bandwidth_gb_s"] > 0 and parts["setup"]["matmul_tflop_s"] > 0
    assert any("test_gpu_sizing.py::" in t for t in parts["tests"]["collected"])
    assert parts["correctness"]["passed"]
    qwen3 = parts["correctness"]["checkpoints"]["qwen3"]
    assert len(qwen3["identical_prefixes"]) == len(gpu_check.DRY_PROMPT_LENGTHS)
    rows = [r for r in parts["sweep"]["rows"] if "step_ms" in r]
    assert {(r["graphs"], r["batch"], r["context"]) for r in rows} == {
        (g, b, c) for g in (True, False) for b in (1, 2) for c in (32, 64)
    }
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and r["x_floor"] > 0 for r in rows)
    assert parts["kernels"]["needs_cuda"] is True
    e2e = parts["e2e"]
    assert e2e["output_tokens"] == e2e["expected_output_tokens"] > 0
    assert e2e["output_tok_s"] > 0 and 0 < e2e["share_of_floor"]
    assert e2e["max_num_seqs"] == 64  # the CPU default, resolved from the Worker's device


def _kernel(x_ptr):
    pass


def test_compiled_variants_counts_each_triton_functions_jit_cache(monkeypatch):
    """What a GPU run reports: the JIT cache size of every actorserve.kernels Triton function,
    through the wrappers (autotuners) around one."""
    import types

    from kernel_variants import compiled_variants
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(_kernel)
    kernel.device_caches = {0: ({"splits=1": None, "splits=2": None, "splits=4": None}, None)}
    module = types.ModuleType("actorserve.kernels.fake_for_test")
    module.kernel = kernel
    module.tuned = types.SimpleNamespace(fn=kernel)  # the same function: counted once
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert compiled_variants()[f"{__name__}._kernel"] == 3
