"""Decode attention over a bf16 paged KV cache in C (kernels/cpu/csrc/cpu_decode_bf16.c), alone:
the time of one layer's call and the K/V bytes it reads, as GB/s.

    python scripts/bench_cpu_attention.py [--rows 16 64] [--contexts 128 256 512 1024]
        [--threads 1 2] [--baseline GIT_REV] [--reps 7] [--json PATH]

Default shape: llama-350m (16 query heads, 8 KV heads, head_dim 64, block_size 16). Every row
of a case has the same context; the cache's blocks are shuffled as a block manager leaves them.
A case owns enough layers (each its own cache) that their K/V together exceed the last-level
cache several times, and each rep runs every layer once, so K/V stream from memory as in a
decode step. Prints per layer: ms and the GB/s of its K/V reads, for the kernel of this tree
and, with --baseline, for the same kernel at a git revision (its kernels/cpu/csrc compiled
into a library of its own, run in the same process on the same inputs); the plain read speed
of as many bytes (bench_common.streaming_read_gb_s) is measured once per thread count.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

from actorserve.kernels.cpu import bindings, build, huge_pages  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STREAM_BYTES = 128 << 20  # K/V per case, at least: four times a 32 MiB last-level cache


def baseline_library(rev: str, into: Path) -> ctypes.CDLL:
    """The CPU kernels at git revision `rev`, compiled into `into` with build.py's flags."""
    csrc = into / "csrc"
    csrc.mkdir()
    listing = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "kernels/cpu/csrc/"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for path in listing:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, check=True
        ).stdout
        (csrc / Path(path).name).write_bytes(source)
    target = into / "baseline.so"
    sources = [str(p) for p in sorted(csrc.glob("*.c"))]
    subprocess.run(["cc", *sources, "-o", str(target), *build.FLAGS], check=True)
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention_bf16.restype = ctypes.c_int
    lib.decode_attention_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr] + [i64] * 5
    lib.decode_attention_bf16.argtypes += [ctypes.c_float, ptr]
    return lib


def cache(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random bf16 cache on 2 MiB pages, as the fast path allocates it (fast_path.py)."""
    return huge_pages.empty(shape, torch.bfloat16).copy_(torch.randn(shape, generator=gen))


class Case:
    """`layers` caches of `rows` sequences of `context` tokens each, and a query per layer."""

    def __init__(self, rows: int, context: int, args: argparse.Namespace) -> None:
        gen = torch.Generator().manual_seed(rows * 7919 + context)
        bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
        per_seq = -(-context // bs)
        num_blocks = rows * per_seq
        self.kv_bytes = 2 * rows * context * hkv * d * 2  # K and V, bf16
        self.layers = max(2, -(-STREAM_BYTES // self.kv_bytes))
        shape = (num_blocks, bs, hkv, d)
        self.caches = [(cache(shape, gen), cache(shape, gen)) for _ in range(self.layers)]
        ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_tables = ids.view(rows, per_seq).contiguous()
        self.seq_lens = torch.full((rows,), context, dtype=torch.int32)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
        self.q = [torch.randn(rows, args.heads, d, generator=gen) for _ in range(self.layers)]
        self.out = torch.empty(rows, args.heads, d)
        self.scale = d**-0.5

    def run(self, lib: ctypes.CDLL) -> None:
        for q, (k, v) in zip(self.q, self.caches):
            bindings.paged_attention(
                lib, "decode", q, k, v, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale, self.out,
            )  # fmt: skip


def seconds_per_layer(case: Case, lib: ctypes.CDLL, reps: int) -> float:
    """Best of `reps` passes over every layer, per layer."""
    case.run(lib)  # warm: the thread pool, first touch of the output
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        case.run(lib)
        best = min(best, time.perf_counter() - start)
    return best / case.layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--baseline", metavar="GIT_REV", default=None)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    lib = bindings.load()
    if lib is None:
        print("no C kernels here (no compiler)", file=sys.stderr)
        return 1
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = baseline_library(args.baseline, Path(tmp)) if args.baseline else None
        for threads in args.threads:
            torch.set_num_threads(threads)
            read = bc.streaming_read_gb_s(STREAM_BYTES, threads)
            for rows in args.rows:
                for context in args.contexts:
                    case = Case(rows, context, args)
                    row = dict(threads=threads, rows=rows, context=context, read_gb_s=read)
                    new = seconds_per_layer(case, lib, args.reps)
                    row.update(ms=new * 1e3, gb_s=case.kv_bytes / new / 1e9)
                    if baseline is not None:
                        old = seconds_per_layer(case, baseline, args.reps)
                        row.update(old_ms=old * 1e3, old_gb_s=case.kv_bytes / old / 1e9)
                        row["speedup"] = old / new
                    rows_out.append(row)
                    del case
    columns = [
        bc.Column("threads", "threads"),
        bc.Column("rows", "rows"),
        bc.Column("context", "context"),
        bc.Column("ms", "ms/layer", "{:.3f}"),
        bc.Column("gb_s", "K/V GB/s", "{:.1f}"),
    ]
    if args.baseline:
        columns += [
            bc.Column("old_ms", f"{args.baseline} ms", "{:.3f}"),
            bc.Column("old_gb_s", f"{args.baseline} GB/s", "{:.1f}"),
            bc.Column("speedup", "speedup", "{:.2f}x"),
        ]
    columns.append(bc.Column("read_gb_s", "plain read GB/s", "{:.1f}"))
    shape = f"{args.heads} q heads, {args.kv_heads} KV heads, head_dim {args.head_dim}"
    title = f"decode attention over a bf16 cache ({shape}, block {args.block_size})"
    print(bc.format_table(rows_out, columns, title, [bc.machine_line(torch.get_num_threads())]))
    bc.write_json(args.json, rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
