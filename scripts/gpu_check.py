"""The prepared GPU check: one run on a CUDA machine (an H200: <= 9 minutes), one JSON file.

    bash scripts/gpu_wheels.sh                       # here, once: the wheels into .whl/
    python3 scripts/gpu_check.py --out $OUT/gpu_check.json [--budget-s 500] [--parts sweep,e2e]
    python scripts/gpu_check.py --dry-run --out /tmp/x.json   # every part's setup, on CPU

On the device machine (the run tool: carry [".whl"], timeout_s 600): the command is the second
line, with PYTHONUNBUFFERED=1 and `2>&1 | tee $OUT/gpu_check.log` for the whole log.

Parts, in this order (the issue's goals first after the tests), each guarded (one that fails
records its error and the next runs), none started once --budget-s is spent (recorded as
skipped); the JSON is rewritten after each part, so a run cut short still leaves what it
measured:
    setup        the carried wheels installed where a module is missing (gpu_check_setup.py),
                 the machine's facts, copy bandwidth and bf16 GEMM rate (the floors' ceilings)
    tests        a. the gpu-marked tests (pytest -m gpu), with the junit XML's summary
    sweep        c. decode steps, batch 1..256 x context 512..2048, graphs and eager, against
                 the HBM floor (gpu_check_sweep.py); compiled attention variants
    e2e          e. nano-vllm's bench workload through the offline LLM: output tok/s, its share
                 of the floor
    correctness  b. greedy bf16 against transformers, logprobs-close (gpu_check_serving.py), on a
                 Qwen3-0.6B-shaped and a Llama-shaped random checkpoint (actorserve/checkpoints,
                 built there: nothing that large travels)
    kernels      d. scripts/bench_kernels.py --quick: the attention kernel's share of the
                 measured bandwidth
--dry-run runs each part at tiny sizes on the CPU with the tiny checkpoints (what needs CUDA is
recorded as such), so that the script is known to work before a GPU window is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

import gpu_check_setup as setup  # noqa: E402  (standard library only: runs before the wheels)

PARTS = ("tests", "sweep", "e2e", "correctness", "kernels")
# the least time a part is started with (a part also checks the deadline as it goes)
MIN_PART_S = 20.0
# what the e2e part leaves of the budget for the engine's shutdown after a workload cut short
SHUTDOWN_S = 40.0
DRY_PROMPT_LENGTHS = [1, 17, 100]  # the correctness part's prompts dry (on GPU: the test's 16)


class Check:
    """The run's settings and what the parts share (the device, the ceilings, the checkpoints)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dry = args.dry_run
        self.deadline = time.monotonic() + args.budget_s
        self.result: dict = {"dry_run": self.dry, "budget_s": args.budget_s, "parts": {}}
        self.device = "cpu"
        self.bandwidth = self.flop_s = 0.0

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str) + "\n")
        tmp.replace(out)

    def checkpoint(self, kind: str) -> Path:
        from actorserve.weights.checkpoints import ensure_checkpoint

        return ensure_checkpoint(kind)

    def qwen3(self) -> Path:
        return self.checkpoint("tiny-qwen3-bf16" if self.dry else "qwen3-0.6b-shape")

    def llama(self) -> Path:
        return self.checkpoint("demo-bf16" if self.dry else "llama-350m")

    def engine_settings(self) -> dict:
        """The offline LLM's settings: as served on CUDA; a small cache and two threads dry."""
        if self.dry:
            return {"device": "cpu", "torch_threads": 2, "num_kv_blocks": 512}
        return {}


def run_part(check: Check, name: str, part) -> None:
    """Run `part(check)` unless the budget is spent; its dict, or its error, into the JSON."""
    if check.left_s() < MIN_PART_S:
        entry = {"status": "skipped", "reason": f"--budget-s spent ({check.left_s():.0f} s left)"}
    else:
        print(f"\n== {name} ({check.left_s():.0f} s left)", flush=True)
        start = time.perf_counter()
        try:
            entry = {"status": "ok", **part(check)}
        except Exception as exc:
            entry = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}"[:4000],
                "traceback": traceback.format_exc()[-4000:],
            }
            print(entry["traceback"], file=sys.stderr, flush=True)
        entry["seconds"] = time.perf_counter() - start
    check.result["parts"][name] = entry
    check.write()


def part_setup(check: Check) -> dict:
    wheels = setup.install_wheels(Path(check.args.wheels))
    found = setup.make_importable()
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: unset it to run the compiled kernels")
    check.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(check.device)
    check.bandwidth = setup.copy_bandwidth_bytes_s(device, (64 if check.dry else 4096) << 20)
    check.flop_s = setup.matmul_flop_s(device, 256 if check.dry else 8192)
    return {
        "wheels": wheels,
        "actorserve": found,
        "machine": setup.machine_facts(),
        "copy_bandwidth_gb_s": check.bandwidth / 1e9,
        "matmul_tflop_s": check.flop_s / 1e12,
    }


def gpu_test_files() -> list[str]:
    """Test modules that hold gpu-marked tests (collecting only those: the rest may import what
    the GPU machine lacks)."""
    marks = ("mark.gpu", "kernel_support")
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if any(mark in p.read_text() for mark in marks)
    )


def junit_summary(path: Path) -> dict:
    """Counts and the failing tests (name, message) of a pytest junit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    failed = []
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            name = f"{case.get('classname')}::{case.get('name')}"
            failed.append({"test": name, "message": (bad.get("message") or "")[:500]})
    return {**counts, "failed": failed}


def part_tests(check: Check) -> dict:
    files = gpu_test_files()
    root = setup.test_root()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
            "--rootdir", str(root), "--continue-on-collection-errors", f"--junitxml={junit}",
            *[str(root / f) for f in files],
        ]  # fmt: skip
        if check.dry:
            command.append("--collect-only")
        timeout = max(10.0, min(check.args.tests_timeout_s, check.left_s() - MIN_PART_S))
        try:
            done = subprocess.run(
                command, cwd=REPO, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stdout or b"")[-3000:]
            return {"files": files, "timed_out_s": timeout, "output_tail": str(tail)}
        summary = junit_summary(junit) if junit.exists() else {}
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    return {
        "files": files,
        "returncode": done.returncode,
        "summary": summary,
        "collected": collected if check.dry else len(collected),
        "output_tail": (done.stdout + done.stderr)[-3000:],
    }


def part_correctness(check: Check) -> dict:
    import gpu_check_serving as serving

    results = {}
    kinds = {"qwen3": check.qwen3} if check.dry else {"qwen3": check.qwen3, "llama": check.llama}
    for name, path in kinds.items():
        if check.left_s() < MIN_PART_S:
            results[name] = {"skipped": "budget"}
            continue
        try:
            results[name] = serving.logprobs_close(
                path(),
                check.device,
                check.engine_settings(),
                DRY_PROMPT_LENGTHS if check.dry else None,
            )
        except Exception as exc:  # one checkpoint failing the criterion: the other still runs
            results[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}
    if check.dry:
        results["llama"] = {"skipped": "dry run: one checkpoint shows the path"}
    checked = [r["passed"] for r in results.values() if "passed" in r]
    return {"checkpoints": results, "passed": bool(checked) and all(checked)}


def part_sweep(check: Check) -> dict:
    import gpu_check_sweep as sweep

    sizes = sweep.DRY_SIZES if check.dry else sweep.CUDA_SIZES
    return sweep.run(check.qwen3(), check.device, sizes, check.bandwidth, check.deadline)


def part_kernels(check: Check) -> dict:
    from kernel_variants import compiled_variants

    if check.device != "cuda":
        return {"needs_cuda": True, "compiled_variants": compiled_variants()}
    import bench_kernels

    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.json"
        peak_tbps = check.bandwidth / 1e12
        flags = ["--quick", "--json", str(rows_path), "--peak-tbps", f"{peak_tbps}"]
        code = bench_kernels.main(flags)
        rows = json.loads(rows_path.read_text()) if rows_path.exists() else []
    decode = [r for r in rows if r["kind"] == "decode"]
    return {
        "exit_code": code,
        "peak_tbps_measured_copy": peak_tbps,
        "rows": rows,
        "decode_pct_of_copy_bandwidth": {
            f"{r['batch']}x{r['context']}": r["pct_peak"] for r in decode
        },
        "compiled_variants": compiled_variants(),
    }


def part_e2e(check: Check) -> dict:
    import gpu_check_serving as serving

    num_seqs, lengths = (4, (8, 16)) if check.dry else (256, (100, 1024))
    return serving.e2e_workload(
        check.qwen3(), num_seqs, lengths, check.engine_settings(), check.bandwidth,
        check.flop_s, max(10.0, check.left_s() - SHUTDOWN_S),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    default_out = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    parser.add_argument("--out", default=str(default_out), help="the JSON file (default $OUT/)")
    parser.add_argument("--budget-s", type=float, default=500.0, help="parts start only before")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)}")
    parser.add_argument("--wheels", default=str(REPO / ".whl"), help="scripts/gpu_wheels.sh's")
    parser.add_argument("--tests-timeout-s", type=float, default=120.0, help="part a's limit")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {PARTS}")
    check = Check(args)
    run_part(check, "setup", part_setup)
    if check.result["parts"]["setup"]["status"] != "ok":
        for name in PARTS:
            check.result["parts"][name] = {"status": "skipped", "reason": "setup failed"}
        check.write()
        return 1
    parts = {"tests": part_tests, "sweep": part_sweep, "e2e": part_e2e}
    parts.update(correctness=part_correctness, kernels=part_kernels)
    for name in PARTS:
        if name in chosen:
            run_part(check, name, parts[name])
        else:
            check.result["parts"][name] = {"status": "skipped", "reason": "not in --parts"}
    check.result["seconds"] = args.budget_s - check.left_s()
    check.write()
    print(f"\nwrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a thread of a part cut short (the e2e workload) must not hold the exit
