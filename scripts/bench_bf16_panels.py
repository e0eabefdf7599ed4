"""The bf16 panel product (kernels/cpu/csrc/cpu_panel_gemm_bf16.c) against torch's F.linear over
a decoder's projection weights in bf16, at decode-sized row counts; with --formats, the fp32,
bf16, int8 and bf16-weight (fp32 rows) panel products (cpu_panel_gemm.c, _bf16.c, _int8.c,
_bf16_weights.c) of single weights side by side.

    python scripts/bench_bf16_panels.py [--hidden 1024 --inter 2816 --heads 16 --kv-heads 8
        --layers 24] [--rows 1 16 64] [--reps 5] [--json PATH]
    python scripts/bench_bf16_panels.py --formats [--rows 1 4 16 64] [--weights 1024x1024
        1024x4096] [--threads N] [--reps 5] [--json PATH]

Default shapes: llama-350m (scripts/ builds it). Each rep runs every layer's four projections
(qkv, o, gate_up, down) once, each layer its own weights, so the weights stream from memory as
in a decode step (together they are far larger than the caches). Prints the time of one pass
and the bandwidth its weight bytes imply, for both, and the ratio.

--formats: for each weight N x K (out x in), enough copies of it that the fp32 ones fill
FORMATS_BYTES (far past the caches: each product reads its weight from memory, as a decode step
does), run once each per rep; per product of each format: GB/s (the bytes of its panels, scales
included, over the time) and GFLOP/s (2 M N K over the time). bf16 only where the CPU has bf16
products (panels.py packs none elsewhere); bf16w (quantization bf16: bf16 weights, fp32 rows)
everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's parent

from actorserve.kernels.cpu.capability import cpu_has_bf16  # noqa: E402
from actorserve.kernels.cpu.panels import PanelLinear  # noqa: E402

FORMATS_BYTES = 256 << 20  # the fp32 copies of a --formats weight


def shapes(args) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections."""
    d = args.hidden // args.heads
    return [
        ((args.heads + 2 * args.kv_heads) * d, args.hidden),
        (args.hidden, args.heads * d),
        (2 * args.inter, args.hidden),
        (args.hidden, args.inter),
    ]


def best_of(reps: int, run) -> float:
    run()  # warm: first-touch of buffers, thread pool
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def formats(args) -> list[dict]:
    """The --formats table (module docstring): one row per weight shape and row count."""
    results = []
    print(f"torch threads {torch.get_num_threads()}; GB/s of panel bytes, GFLOP/s")
    kinds = ["fp32", "bf16", "int8", "bf16w"] if cpu_has_bf16() else ["fp32", "int8", "bf16w"]
    header = ["weight", "rows"] + [f"{k} {unit}" for k in kinds for unit in ("ms", "GB/s", "GF/s")]
    print(" ".join(f"{h:>10}" for h in header))
    for shape in args.weights:
        n, k = map(int, shape.split("x"))
        copies = max(1, FORMATS_BYTES // (4 * n * k))
        torch.manual_seed(0)
        weights = [torch.randn(n, k) for _ in range(copies)]
        packed = {
            "fp32": [PanelLinear.for_weight(w) for w in weights],
            "bf16": [PanelLinear.for_weight(w.bfloat16()) for w in weights]
            if "bf16" in kinds
            else [],
            "int8": [PanelLinear.for_weight(w, int8=True) for w in weights],
            "bf16w": [PanelLinear.for_weight(w, bf16_weights=True) for w in weights],
        }
        del weights
        for rows in args.rows:
            x = torch.randn(rows, k)
            row = {"weight": shape, "rows": rows}
            cells = []
            for kind in kinds:
                inputs = x.bfloat16() if kind == "bf16" else x

                def run(panels=packed[kind], inputs=inputs):
                    for p in panels:
                        p(inputs)

                seconds = best_of(args.reps, run) / copies
                nbytes = packed[kind][0].panels.numel() * packed[kind][0].panels.element_size()
                row[kind] = dict(
                    ms=seconds * 1e3,
                    gbps=nbytes / seconds / 1e9,
                    gflops=2 * rows * n * k / seconds / 1e9,
                )
                cells += [
                    f"{row[kind]['ms']:.3f}",
                    f"{row[kind]['gbps']:.1f}",
                    f"{row[kind]['gflops']:.1f}",
                ]
            results.append(row)
            print(" ".join(f"{c:>10}" for c in [shape, str(rows), *cells]))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument(
        "--rows", type=int, nargs="+", help="default: 1 16 64 (--formats 1 4 16 64)"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--formats", action="store_true", help="fp32 / bf16 / int8 / bf16-weight panels"
    )
    parser.add_argument("--threads", type=int, help="torch (and kernel) threads; default torch's")
    parser.add_argument("--weights", nargs="+", default=["1024x1024", "1024x4096"], help="NxK")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.formats:
        if PanelLinear.for_weight(torch.zeros(1, 1)) is None:
            print("no C kernels here (no compiler)", file=sys.stderr)
            return 1
        args.rows = args.rows or [1, 4, 16, 64]
        results = formats(args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    args.rows = args.rows or [1, 16, 64]
    torch.manual_seed(0)
    weights = [torch.randn(n, k).bfloat16() for _ in range(args.layers) for n, k in shapes(args)]
    panels = [PanelLinear.for_weight(w, bf16=True) for w in weights]
    if any(p is None for p in panels):
        print("no C kernels here (no compiler)", file=sys.stderr)
        return 1
    nbytes = sum(w.numel() * 2 for w in weights)
    results = []
    threads = torch.get_num_threads()
    print(f"{len(weights)} bf16 weights, {nbytes / 1e6:.0f} MB, torch threads {threads}")
    header = ("rows", "panels ms", "GB/s", "F.linear ms", "GB/s", "speedup")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 10, 6, 12, 6, 8))))
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in shapes(args)}}

        def run_panels(inputs=inputs):
            for w, p in zip(weights, panels):
                p(inputs[w.shape[1]])

        def run_torch(inputs=inputs):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        t_panels, t_torch = best_of(args.reps, run_panels), best_of(args.reps, run_torch)
        row = dict(rows=rows, panels_ms=t_panels * 1e3, torch_ms=t_torch * 1e3)
        row.update(panels_gbps=nbytes / t_panels / 1e9, torch_gbps=nbytes / t_torch / 1e9)
        results.append(row)
        print(
            f"{rows:>5} {row['panels_ms']:>10.1f} {row['panels_gbps']:>6.1f} "
            f"{row['torch_ms']:>12.1f} {row['torch_gbps']:>6.1f} {t_torch / t_panels:>7.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
