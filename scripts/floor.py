"""The floor: the workload's useful matmul work, and the least time any engine with weights and
K/V of a given dtype (4 bytes a value for fp32, 2 for bf16) can take on it given the machine's
GEMM peak at that dtype and its memory read bandwidth (both measured by bench_common).
bench_throughput compares each backend's wall time to it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from bench_common import ModelShape, Request


def matmul_flops(shape: ModelShape, workload: list[Request]) -> float:
    """The workload's useful matmul work: 2 x decoder-layer params for every token that goes
    through the decoder (every prompt token and every sampled token but each request's last),
    plus 2 x lm_head params for every sampled token. Attention and the embedding are left out."""
    decoder_tokens = sum(len(r.prompt_ids) + r.output_len - 1 for r in workload)
    sampled = sum(r.output_len for r in workload)
    return 2.0 * shape.layer_matmul_params * decoder_tokens + 2.0 * shape.lm_head_params * sampled


@dataclass(frozen=True)
class Floor:
    """The least time an engine with weights and K/V of one dtype can take on a workload, given the
    machine's GEMM peak and memory read bandwidth (a lower bound on any engine, not a model of
    actorserve's). Parts, each in seconds:

    prefill_s     every prompt token's matmul work, and each request's first lm_head row, at the
                  GEMM peak (prefill reads each weight once per thousands of tokens)
    gemm_s        each decode step (decode_steps: every request still generating in one batch,
                  the schedule that reads the weights the fewest times, or every one of the
                  `concurrency` in flight): the step's matmul work at the peak or its weights
                  (decoder layers + lm_head) at the read bandwidth, whichever is longer (the
                  weights stream in while the GEMMs run)
    kv_s          each decode step's K and V of every row (prompt + k tokens, all layers), read
                  once at the read bandwidth; attention's own FLOPs are left out
    overlapped_s  prefill_s + each decode step's matmul work at the peak or all its bytes
                  (weights and K/V) at the read bandwidth, whichever is longer: K/V reads hidden
                  under the GEMMs, the bound no schedule can beat
    """

    prefill_s: float
    gemm_s: float
    kv_s: float
    overlapped_s: float

    @property
    def serial_s(self) -> float:
        """K/V read after the step's GEMMs (a layer's attention needs its projections, the next
        projection its output)."""
        return self.prefill_s + self.gemm_s + self.kv_s


def decode_steps(workload: list[Request], concurrency: int | None = None) -> list[list[int]]:
    """Each decode step's rows, as their contexts (prompt + tokens so far), when at most
    `concurrency` requests (default: all) are in flight and every one in flight decodes at every
    step: the requests in order, each starting in the slot that frees first (a closed-loop
    client's order), its first token made by its prefill and each later one by a decode step."""
    slots = [(0, slot) for slot in range(min(concurrency or len(workload), len(workload)))]
    steps: list[list[int]] = []
    for r in workload:
        at, slot = heapq.heappop(slots)
        for k in range(1, r.output_len):
            if len(steps) < at + k:
                steps.append([])
            steps[at + k - 1].append(len(r.prompt_ids) + k)
        heapq.heappush(slots, (at + max(r.output_len - 1, 0), slot))
    return steps


def engine_floor(
    shape: ModelShape,
    workload: list[Request],
    peak_flop_s: float,
    read_bytes_s: float,
    weight_value_bytes: float = 4,
    kv_value_bytes: float = 4,
    concurrency: int | None = None,
) -> Floor:
    """The workload's Floor (see there) on this machine's measured peak (at the weights' dtype)
    and read bandwidth, with weights of `weight_value_bytes` a value and K/V of
    `kv_value_bytes` (4: fp32, 2: bf16, 1: int8), at most `concurrency` requests in flight
    (default: all of them in one batch)."""
    weight_bytes = float(weight_value_bytes) * (shape.layer_matmul_params + shape.lm_head_params)
    decode_row_flops = 2.0 * (shape.layer_matmul_params + shape.lm_head_params)
    prefill_s = (
        sum(
            2.0 * shape.layer_matmul_params * len(r.prompt_ids) + 2.0 * shape.lm_head_params
            for r in workload
        )
        / peak_flop_s
    )
    gemm_s = kv_s = overlapped_s = 0.0
    for contexts in decode_steps(workload, concurrency):
        compute_s = decode_row_flops * len(contexts) / peak_flop_s
        kv_bytes = shape.kv_values_per_token * kv_value_bytes * sum(contexts)
        gemm_s += max(compute_s, weight_bytes / read_bytes_s)
        kv_s += kv_bytes / read_bytes_s
        overlapped_s += max(compute_s, (weight_bytes + kv_bytes) / read_bytes_s)
    return Floor(prefill_s, gemm_s, kv_s, prefill_s + overlapped_s)
