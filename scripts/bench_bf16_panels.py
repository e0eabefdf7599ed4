"""The bf16 panel product (kernels/cpu/csrc/cpu_panel_gemm_bf16.c) against torch's F.linear over
a decoder's projection weights in bf16, at decode-sized row counts.

    python scripts/bench_bf16_panels.py [--hidden 1024 --inter 2816 --heads 16 --kv-heads 8
        --layers 24] [--rows 1 16 64] [--reps 5] [--json PATH]

Default shapes: llama-350m (scripts/ builds it). Each rep runs every layer's four projections
(qkv, o, gate_up, down) once, each layer its own weights, so the weights stream from memory as
in a decode step (together they are far larger than the caches). Prints the time of one pass
and the bandwidth its weight bytes imply, for both, and the ratio.
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

from actorserve.kernels.cpu.panels import PanelLinear  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
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
