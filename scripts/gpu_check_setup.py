"""What scripts/gpu_check.py needs before its parts run: the carried wheels installed, actorserve
importable, and the machine's facts (device, versions, copy bandwidth, bf16 GEMM rate).

Only the standard library at import time: the wheels this module installs (scripts/gpu_wheels.sh)
are what the rest of the check imports.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# modules the engine, its gateway and the gpu tests import that the GPU image may lack
NEEDED_MODULES = (
    "msgspec",
    "zmq",
    "xgrammar",
    "fastapi",
    "uvicorn",
    "websockets",
    "pydantic",
    "pytest_asyncio",
)
SITE = Path(tempfile.gettempdir()) / "actorserve-gpu-check-site"
IMPORT_ROOT = Path(tempfile.gettempdir()) / "actorserve-gpu-check-path"


def missing_modules() -> list[str]:
    return [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]


def prepend_path(variable: str, entry: Path) -> None:
    """`entry` first on sys.path (this process) and in `variable` (the processes it starts)."""
    sys.path.insert(0, str(entry))
    parts = [p for p in os.environ.get(variable, "").split(os.pathsep) if p]
    os.environ[variable] = os.pathsep.join([str(entry), *parts])
    importlib.invalidate_caches()


def install_wheels(wheels: Path) -> dict:
    """Install every wheel under `wheels` into SITE (no index, no dependencies: the folder holds
    them all) when a needed module is missing; put SITE on the import path either way."""
    missing = missing_modules()
    report = {"missing_before": missing, "wheels_dir": str(wheels), "installed": []}
    if missing:
        files = sorted(str(p) for p in wheels.glob("*.whl")) if wheels.is_dir() else []
        if not files:
            report["error"] = f"no wheels under {wheels}: run scripts/gpu_wheels.sh and carry it"
            return report
        command = [
            sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE), *files,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        report["installed"] = [Path(f).name for f in files]
        if done.returncode != 0:
            report["error"] = done.stderr[-2000:]
    if SITE.is_dir():
        prepend_path("PYTHONPATH", SITE)
    report["missing_after"] = missing_modules()
    return report


def linked_repo() -> Path:
    """IMPORT_ROOT/actorserve, a link to this checkout (made here if missing)."""
    IMPORT_ROOT.mkdir(parents=True, exist_ok=True)
    link = IMPORT_ROOT / "actorserve"
    if link.is_symlink() and link.resolve() != REPO:
        link.unlink()
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    return link


def make_importable() -> str:
    """`import actorserve` loads this checkout: where it does not already (no `pip install -e`
    there), IMPORT_ROOT, the folder of linked_repo(), goes on the import path."""
    spec = importlib.util.find_spec("actorserve")
    if spec is None or Path(spec.origin or "").resolve().parent != REPO:
        linked_repo()
        prepend_path("PYTHONPATH", IMPORT_ROOT)
    import actorserve

    return actorserve.__file__


def test_root() -> Path:
    """Where pytest is to find the tests: the checkout, unless its folder's name is no Python
    identifier (pytest imports the checkout's own __init__.py as a package of that name, which
    then fails); then the checkout through linked_repo(), named `actorserve`."""
    return REPO if REPO.name.isidentifier() else linked_repo()


def machine_facts() -> dict:
    """The device, the versions that matter and (CUDA) the driver's view."""
    import torch

    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    for name in ("triton", "transformers", "xgrammar", "msgspec", "pyzmq", "pytest"):
        try:
            facts[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # a finding, not a failure of the check
            facts[name] = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            device=props.name,
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
        )
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv"],
            capture_output=True,
            text=True,
        )
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    return facts


def copy_bandwidth_bytes_s(device, num_bytes: int) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy of `num_bytes`: the
    bandwidth a memory-bound kernel can reach (the best of 10 after warm-up). On CPU: the read
    rate of bench_common.streaming_read_gb_s."""
    import torch

    if device.type != "cuda":
        import bench_common as bc

        return bc.streaming_read_gb_s(num_bytes) * 1e9
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / best


def matmul_flop_s(device, n: int) -> float:
    """FLOP/s of an n x n x n matmul in the device's serving dtype (bf16 on CUDA, fp32 on CPU),
    the best of 5 after 2 warm-ups: the GEMM peak of the floors."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for i in range(7):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best
