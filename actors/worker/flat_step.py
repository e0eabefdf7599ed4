"""A step's flat inputs as numbers (numpy), read from the persistent batch in one vectorized
pass: the tokens of request after request, their positions and cache slots, each request's
context length and query offsets, which block table rows the step reads and which rows sample.

The runner turns them into tensors one of two ways: as they are, on the host (the CPU without
the fast path's decode hook), or staged into persistent buffers (step_buffers.py: CUDA, and the
decode graphs' path on any device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .block_tables import BlockTables
from .decode_batch import sample_rows_of
from .models.llama import AttentionMetadata

if TYPE_CHECKING:
    from .cached_request import CachedRequest
    from .sample_row import SampleRow


class StepTensors(NamedTuple):
    """A step's inputs as the model reads them (on the host, or views of the step buffers)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor | None


@dataclass
class FlatStep:
    """T tokens from B requests, laid out request after request (T == B: decodes alone).

    input_ids, positions, slots [T]: token t's id, position and cache slot (block * block_size +
    offset); seq_lens [B]: each request's context after the step; query_start [B + 1]: request b
    owns tokens [query_start[b], query_start[b + 1]); table_rows [B]: its BlockTables row, of
    which the first `width` columns cover every request's blocks; sample_index: the tokens whose
    hidden states sample, None when every token does."""

    input_ids: list[int]
    positions: np.ndarray  # int64
    slots: np.ndarray  # int64
    seq_lens: np.ndarray  # int32
    query_start: np.ndarray  # int32
    table_rows: np.ndarray  # int64
    width: int
    sample_index: np.ndarray | None  # int64
    sample_ids: list[str]
    sample_rows: list[SampleRow]
    requests: list[CachedRequest]  # the scheduled ones, in the step's order
    sample_requests: list[CachedRequest]  # those that sample, in sample_ids' order

    @property
    def decodes_only(self) -> bool:
        return len(self.input_ids) == len(self.requests)

    def host_tensors(self, block_tables: BlockTables) -> StepTensors:
        """Host tensors over these numbers (no copy but the gathered tables)."""
        tables = block_tables.gather(self.table_rows, self.width)
        meta = AttentionMetadata(
            torch.from_numpy(self.slots), torch.from_numpy(tables),
            torch.from_numpy(self.seq_lens), torch.from_numpy(self.query_start),
        )  # fmt: skip
        index = self.sample_index
        return StepTensors(
            torch.tensor(self.input_ids, dtype=torch.long), torch.from_numpy(self.positions),
            meta, None if index is None else torch.from_numpy(index),
        )  # fmt: skip


def flat_step(
    scheduled: list[tuple[str, int]],
    requests: dict[str, CachedRequest],
    block_tables: BlockTables,
    block_size: int,
) -> FlatStep:
    """The step that computes `count` tokens of each (request id, count) in `scheduled`.
    Raises ValueError when a request would compute past the blocks it holds."""
    bs = block_size
    n = len(scheduled)
    reqs = [requests[rid] for rid, _ in scheduled]
    counts = np.fromiter((count for _, count in scheduled), np.int64, n)
    starts = np.fromiter((r.num_computed for r in reqs), np.int64, n)
    ends = starts + counts
    query_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])
    num_blocks = np.fromiter((r.num_blocks for r in reqs), np.int64, n)
    if bool((ends > num_blocks * bs).any()):
        b = int(np.flatnonzero(ends > num_blocks * bs)[0])
        raise past_blocks(scheduled[b][0], int(ends[b]), int(num_blocks[b]), bs)
    table_rows = np.fromiter((r.row for r in reqs), np.int64, n)
    if total == n:  # decodes only: one token each
        token_rows, positions = table_rows, starts
        ids = [r.token_ids[i] for r, i in zip(reqs, starts.tolist())]
    else:
        token_rows = np.repeat(table_rows, counts)
        positions = np.arange(total, dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)
        ids = []
        for r, start, end in zip(reqs, starts.tolist(), ends.tolist()):
            ids.extend(r.token_ids[start:end])
    blocks = block_tables.table[token_rows, positions // bs]
    slots = blocks.astype(np.int64) * bs + positions % bs
    lengths = np.fromiter((len(r.token_ids) for r in reqs), np.int64, n)
    sampling = np.flatnonzero(ends == lengths)  # requests that reach their last token
    sample_ids, sample_rows, sample_reqs = sample_rows_of(
        scheduled, reqs, zip(sampling.tolist(), ends[sampling].tolist())
    )
    sample_index = query_start[1:][sampling] - 1 if len(sampling) < total else None
    return FlatStep(
        ids, positions, slots, ends.astype(np.int32), query_start.astype(np.int32), table_rows,
        int(num_blocks.max()), sample_index, sample_ids, sample_rows, reqs, sample_reqs,
    )  # fmt: skip


def past_blocks(request_id: str, end: int, num_blocks: int, block_size: int) -> ValueError:
    return ValueError(
        f"request {request_id} computes up to token {end} but holds {num_blocks} blocks "
        f"of {block_size}"
    )
