"""What tensor and data parallelism should buy on GPUs, on paper: a bandwidth model of one decode
step, printed as tables for docs/operations.md. Nothing here runs a model.

A decode step of B rows at context C on TP ranks (bf16 weights and K/V) takes at least

    weights / (TP x HBM)                 each rank streams its shard of every weight once
  + B x C x kv_bytes_per_token / (TP x HBM)   its KV heads' share of every row's context
  + 2 x layers x allreduce(B x hidden x 2 bytes)   o_proj's and down_proj's partial sums

and an all-reduce of m bytes over n ranks takes `latency + 2 (n - 1) / n x m / link` (a ring:
each byte leaves and enters every rank about twice). KV heads fewer than the ranks are
replicated, so their share stops shrinking at num_kv_heads ranks. Data parallelism is N copies
of the TP=1 step on N devices: N times the throughput at the same step time, and each replica
keeps its own prefix cache (why the gateway routes shared prefixes to one).

Usage: python scripts/scaling_model.py [--hbm-gb-s 4800 --link-gb-s 450 --latency-us 8]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    params: float  # all weights, embedding and LM head included
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, kv_ranks: int) -> float:
        """K and V of one token over all layers, on one rank holding 1/kv_ranks of the heads."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2 / kv_ranks


# Shapes of released checkpoints (their config.json), bf16
SHAPES = (
    Shape("Qwen3-0.6B", 0.60e9, 28, 1024, 8, 128),
    Shape("Llama-3.1-8B", 8.03e9, 32, 4096, 8, 128),
    Shape("Llama-3.1-70B", 70.6e9, 80, 8192, 8, 128),
)


@dataclass(frozen=True)
class Machine:
    hbm_bytes_s: float
    link_bytes_s: float  # one direction, per GPU
    latency_s: float  # a small all-reduce's fixed cost
    memory_bytes: float

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        return self.latency_s + 2 * (ranks - 1) / ranks * nbytes / self.link_bytes_s


def fits(shape: Shape, machine: Machine, tp: int, rows: int, context: int) -> bool:
    """Whether a rank holds its weights and its share of the rows' K/V in 90% of its memory."""
    kv_ranks = min(tp, shape.kv_heads)
    need = shape.params * 2 / tp + rows * context * shape.kv_bytes_per_token(kv_ranks)
    return need <= 0.9 * machine.memory_bytes


def step_s(shape: Shape, machine: Machine, tp: int, rows: int, context: int) -> tuple[float, float]:
    """(the step's least time, of which all-reduce) for `rows` decodes at `context` tokens."""
    kv_ranks = min(tp, shape.kv_heads)
    read = shape.params * 2 / tp + rows * context * shape.kv_bytes_per_token(kv_ranks)
    reduce = 2 * shape.layers * machine.all_reduce_s(rows * shape.hidden * 2, tp)
    return read / machine.hbm_bytes_s + reduce, reduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hbm-gb-s", type=float, default=4800.0, help="H200: 4.8 TB/s")
    parser.add_argument(
        "--link-gb-s", type=float, default=450.0, help="NVLink 4, one direction per GPU"
    )
    parser.add_argument("--latency-us", type=float, default=8.0, help="a small all-reduce")
    parser.add_argument("--memory-gb", type=float, default=141.0, help="H200: 141 GB")
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    machine = Machine(
        args.hbm_gb_s * 1e9, args.link_gb_s * 1e9, args.latency_us * 1e-6, args.memory_gb * 1e9
    )
    print(
        f"decode step at context {args.context}, HBM {args.hbm_gb_s:.0f} GB/s, link "
        f"{args.link_gb_s:.0f} GB/s, all-reduce latency {args.latency_us:.0f} us"
    )
    print("(a step that does not fit in 90% of one GPU's memory is marked *; DP needs TP=1 to fit)")
    print(
        f"{'model':<14} {'rows':>5} {'TP':>3} {'step ms':>8} {'all-red ms':>10} "
        f"{'speedup':>8} {'tok/s':>9} {'DP=TP tok/s':>12}"
    )
    for shape in SHAPES:
        for rows in (1, 64, 256):
            single, _ = step_s(shape, machine, 1, rows, args.context)
            for tp in (1, 2, 4, 8):
                step, reduce = step_s(shape, machine, tp, rows, args.context)
                # tp replicas of TP=1 instead, each with `rows` rows
                dp = (
                    f"{tp * rows / single:.0f}"
                    if fits(shape, machine, 1, rows, args.context)
                    else "-"
                )
                mark = " " if fits(shape, machine, tp, rows, args.context) else "*"
                print(
                    f"{shape.name:<14} {rows:>5} {tp:>3} {step * 1e3:>8.3f} {reduce * 1e3:>10.3f} "
                    f"{single / step:>7.2f}x {rows / step:>9.0f}{mark} {dp:>11}"
                )


if __name__ == "__main__":
    main()
