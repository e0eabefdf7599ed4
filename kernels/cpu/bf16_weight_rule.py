"""Whether bf16-weight panels (quantization bf16) beat fp32 panels on this CPU, measured: the
rule `dtype auto` applies to a bf16 checkpoint on a CPU without bf16 arithmetic
(actors/worker/dtypes.py), where the model otherwise runs upcast to fp32.

A decode step at a few rows is bound by the bytes of weight it reads, and bf16 weights halve
them; but each bf16 row costs a widening (vpmovzxwd + vpslld) per vector, so where the weights
come from cache, or the core rather than memory is the limit, fp32 panels may be as fast. Which
one wins depends on the CPU's memory and cores, so it is timed, not assumed: one product of a
representative weight (the model's largest projection, capped at MAX_WEIGHT_BYTES of fp32 so
that the timing stays a few tens of ms at worst) in each format at the row counts decode steps
have (DECODE_ROWS), best of a few calls each. bf16 weights are chosen where they are faster at
every one of those row counts, so that no decode batch size gets slower (where the two tie
within noise either choice is as fast). The times go into the log line that states the choice.
"""

from __future__ import annotations

import ctypes
import time
from typing import NamedTuple

import torch

from . import bindings, panel_bindings

DECODE_ROWS = (1, 4, 16)
MAX_WEIGHT_BYTES = 32 << 20  # of the fp32 weight timed: above most CPUs' last-level cache share
REPEATS = 3  # calls timed per format and row count, after one that warms the code


class PanelTimes(NamedTuple):
    """Seconds of one product at each row count, in fp32 panels and in bf16-weight panels."""

    rows: tuple[int, ...]
    fp32_s: tuple[float, ...]
    bf16_weights_s: tuple[float, ...]

    def describe(self) -> str:
        """e.g. "1 row: fp32 2.10 ms, bf16 weights 1.20 ms; 4 rows: ..." (for the log)."""
        return "; ".join(
            f"{m} row{'s' * (m > 1)}: fp32 {wide * 1e3:.2f} ms, bf16 weights {narrow * 1e3:.2f} ms"
            for m, wide, narrow in zip(self.rows, self.fp32_s, self.bf16_weights_s, strict=True)
        )


def bf16_weights_win(times: PanelTimes) -> bool:
    """Whether bf16-weight panels are faster than fp32 panels at every row count timed."""
    return all(
        narrow < wide for wide, narrow in zip(times.fp32_s, times.bf16_weights_s, strict=True)
    )


def timed_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """The weight [N, K] to time for a model whose largest projection is [out_features,
    in_features]: that one, with fewer rows where its fp32 bytes pass MAX_WEIGHT_BYTES."""
    rows = min(out_features, max(1, MAX_WEIGHT_BYTES // (4 * in_features)))
    return rows, in_features


def measure(
    lib: ctypes.CDLL, shape: tuple[int, int], huge: bool = True, rows=DECODE_ROWS
) -> PanelTimes:
    """Time x [m, K] @ W.T for W [N, K] = `shape` in fp32 panels and in bf16-weight panels,
    for each m in `rows`: the best of REPEATS calls each (the values do not matter to the
    time; the weight is a constant)."""
    weight = torch.full(shape, 0.5)
    kinds = (
        (panel_bindings.panel_linear, panel_bindings.pack_panels(lib, weight, huge)),
        (
            panel_bindings.panel_linear_bf16_weights,
            panel_bindings.pack_panels_bf16_weights(lib, weight, huge),
        ),
    )
    del weight
    times: list[list[float]] = [[], []]
    for m in rows:
        x = torch.full((m, shape[1]), 0.25)
        for kind, (product, panels) in enumerate(kinds):
            product(lib, x, panels, shape[0])  # warm: the code, and the pages touched once
            best = float("inf")
            for _ in range(REPEATS):
                start = time.perf_counter()
                product(lib, x, panels, shape[0])
                best = min(best, time.perf_counter() - start)
            times[kind].append(best)
    return PanelTimes(tuple(rows), tuple(times[0]), tuple(times[1]))


def measure_model(config, huge: bool = True) -> PanelTimes | None:
    """`measure` on the largest projection of a model (a ModelConfig: hidden_size, num_heads,
    num_kv_heads, head_dim, intermediate_size), capped by timed_shape; None without the C
    kernels (no compiler: the fast path is off, so is the choice)."""
    lib = bindings.load()
    if lib is None:
        return None
    c = config
    hidden, q = c.hidden_size, c.num_heads * c.head_dim
    projections = [
        ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, hidden),  # qkv
        (hidden, q),  # o
        (2 * c.intermediate_size, hidden),  # gate_up
        (hidden, c.intermediate_size),  # down
    ]
    largest = max(projections, key=lambda shape: shape[0] * shape[1])
    return measure(lib, timed_shape(*largest), huge)
