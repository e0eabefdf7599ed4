"""A step of decodes over the same requests as the step before makes its inputs from the last.

In steady decoding each step runs the same requests in the same order, one token each, and each
samples. The runner keeps such a step's numbers (DecodeBatch) and, when the next plan schedules
the same requests again, advances them instead of reading every request in Python: one more token
computed, the token just sampled, the blocks the plan added. One C call then rewrites the flat
inputs in buffers the step's tensors already view (the CPU fast path's DecodeInputs,
kernels/cpu/decode_inputs.py). Only the fast path's steps have one: it is the runner's record of
such a step, while the fast path owns the buffers and the C.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ...kernels.cpu.decode_inputs import DecodeInputs
    from ...kernels.cpu.fast_path import CpuFastPath
    from .cached_request import CachedRequest
    from .sample_row import SampleRow


@dataclass
class DecodeBatch:
    """requests[i] computes one token; `numbers[i]` = (tokens computed, blocks held, block table
    row, the token at the computed position) of requests[i], which stay equal to
    (r.num_computed, r.num_blocks, r.row, r.token_ids[r.num_computed]) as of each `fill`, while
    the runner calls `grew` for the requests a plan gave blocks and, after a step in which every
    request sampled (the runner then appended the token and counted it computed), `advance`.
    `sample_index`: the requests that sample (their token is their last), None when all do."""

    scheduled: list[tuple[str, int]]
    requests: list[CachedRequest]
    numbers: np.ndarray
    inputs: DecodeInputs
    sample_index: list[int] | None
    sample_ids: list[str]
    sample_rows: list[SampleRow]
    rows_read_positions: bool  # a row's sampling reads its position or output count
    next_tokens: torch.Tensor | None = None  # sampled by the step before, not yet in `numbers`

    @classmethod
    def of(
        cls,
        scheduled: list[tuple[str, int]],
        requests: list[CachedRequest],
        columns: int,
        fast_path: CpuFastPath,
    ):
        flat, samples = [], []
        for i, r in enumerate(requests):  # one pass: each Python step here runs on cold caches
            computed, tokens = r.num_computed, r.token_ids
            flat += (computed, r.num_blocks, r.row, tokens[computed])
            if computed + 1 == len(tokens):  # its last token: it samples
                samples.append(i)
        n = len(requests)
        numbers = np.array(flat, dtype=np.int64).reshape(n, 4)
        ends = ((i, requests[i].num_computed + 1) for i in samples)
        sample_ids, sample_rows, _ = sample_rows_of(scheduled, requests, ends)
        reads = any(row.plain_from != 0 for row in sample_rows)  # see sampler.is_plain_greedy
        index = None if len(samples) == n else samples
        inputs = fast_path.decode_inputs(numbers, columns)
        return cls(scheduled, requests, numbers, inputs, index, sample_ids, sample_rows, reads)

    def grew(self, grown: list[tuple[int, CachedRequest]]) -> None:
        """(index, request) of the requests whose blocks the plan grew."""
        for i, r in grown:
            self.numbers[i, 1] = r.num_blocks

    def advance(self, tokens: torch.Tensor) -> None:
        """The step computed each request's token and sampled `tokens` [n] int64 (the runner
        appended them): the numbers move on by them in the next step's `fill`, the rows now."""
        self.next_tokens = tokens
        if self.rows_read_positions:
            for row in self.sample_rows:
                row.position += 1
                row.num_output += 1

    def fill(self, table: np.ndarray, block_size: int) -> int | None:
        """The step's flat inputs into `inputs` (DecodeInputs.fill)."""
        tokens, self.next_tokens = self.next_tokens, None
        return self.inputs.fill(table, block_size, tokens)


def sample_rows_of(scheduled, requests: list[CachedRequest], samples) -> tuple[list, list, list]:
    """For each (index, end) in `samples`, request `index` reaches its last token at `end`:
    -> their ids, SampleRows (each set to sample position `end`) and CachedRequests."""
    sample_ids, sample_rows, sample_reqs = [], [], []
    for i, end in samples:
        r = requests[i]
        sample_ids.append(scheduled[i][0])
        row = r.sample_row
        row.position, row.num_output = end, end - r.num_prompt_tokens
        sample_rows.append(row)
        sample_reqs.append(r)
    return sample_ids, sample_rows, sample_reqs
