"""A step's inputs in persistent buffers: pinned host staging written in place, device twins.

Each input (token ids, positions, slots, context lengths, query offsets, the rows that sample,
the block table rows a step reads) has one host buffer, pinned on CUDA and written through a
numpy view, and one device buffer of the same size: a step writes its numbers into the host
buffers and copies the used prefix of each to the device (non_blocking, on the copy stream). The
buffers are sized once, for max_num_batched_tokens tokens and max_num_seqs sequences, and never
move: a decode graph (graph_runner.py) captured over their prefixes reads each step's inputs.

The block tables stay on the device (DeviceBlockTables), updated by the rows that changed since
the step before; a step's tables are one gather there, never a [B, width] host copy.

Stream ordering (CUDA): the host waits for the previous step's copies (an event) before writing
the staging buffers again, as a non_blocking copy reads its source after the call returns; the
copy stream waits for the compute stream before overwriting the device buffers the previous
step's forward read; the compute stream waits for the copies (an event) before it reads them.
Every tensor that crosses the two streams is a persistent buffer, which the caching allocator
never hands out again while a stream may still use it, so no record_stream is needed; the one
buffer ever replaced, the device block table when BlockTables grows, is dropped only after the
device has finished with it (DeviceBlockTables.sync).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .block_tables import BlockTables
from .flat_step import FlatStep, StepTensors
from .models.llama import AttentionMetadata


class Staged:
    """One input: a host buffer (pinned on CUDA; `view` is its numpy view) and its device twin."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.view = self.host.numpy()
        self.device = torch.zeros(size, dtype=dtype, device=device)

    def send(self, count: int) -> torch.Tensor:
        """Copy the first `count` values to the device (on the current stream): their view."""
        out = self.device[:count]
        out.copy_(self.host[:count], non_blocking=True)
        return out


class DeviceBlockTables:
    """The device copy of BlockTables.table, [rows, width] int32 with width at least
    `min_width`, kept equal to it by `sync`: the rows BlockTables says changed are staged
    (pinned), copied and scattered in; after a clear or a growth the whole table is copied."""

    def __init__(self, tables: BlockTables, min_width: int, device: torch.device):
        self.tables, self.min_width, self.device = tables, min_width, device
        self._allocate(*tables.table.shape)

    def _allocate(self, rows: int, columns: int) -> None:
        width = max(self.min_width, columns)
        self.table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        self.rows = Staged(rows * width, torch.int32, self.device)  # the changed rows, in order
        self.index = Staged(rows, torch.int64, self.device)  # which rows they are

    def sync(self) -> None:
        """Bring the device table up to date, on the current stream."""
        host = self.tables.table
        changed = self.tables.take_changes()
        rows, columns = host.shape
        if rows > self.table.shape[0] or columns > self.table.shape[1]:
            if self.device.type == "cuda":  # the old table may still be read: let it finish
                torch.cuda.synchronize(self.device)
            self._allocate(rows, columns)
            changed = None
        if changed is None:
            self.table.zero_()
            self.table[:rows, :columns].copy_(torch.from_numpy(host))
            return
        if not changed:
            return
        count, width = len(changed), self.table.shape[1]
        staged = self.rows.view[: count * width].reshape(count, width)
        staged[:, :columns] = host[changed]
        staged[:, columns:] = 0
        self.index.view[:count] = changed
        index = self.index.send(count)
        values = self.rows.send(count * width).view(count, width)
        self.table.index_copy_(0, index, values)


class StepBuffers:
    """The persistent inputs of every step on this device. `graph_width`: the block table
    width of a decode graph's steps, ceil(max_model_len / block_size): every table fits it."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        block_tables: BlockTables,
        graph_width: int,
        device: torch.device,
        copy_stream: torch.cuda.Stream | None,
    ):
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.device, self.copy_stream = device, copy_stream
        self.input_ids = Staged(max_tokens, torch.int64, device)
        self.positions = Staged(max_tokens, torch.int64, device)
        self.slot_mapping = Staged(max_tokens, torch.int64, device)
        self.sample_index = Staged(max_tokens, torch.int64, device)
        self.seq_lens = Staged(max_seqs, torch.int32, device)
        self.query_start_loc = Staged(max_seqs + 1, torch.int32, device)
        self.table_rows = Staged(max_seqs, torch.int64, device)
        self.tables = DeviceBlockTables(block_tables, graph_width, device)
        self.graph_width = graph_width
        # a decode graph's block tables: rows past a step's own keep earlier block ids (each a
        # valid block, and a padded row reads only its first: see pad_decode)
        self.graph_tables = torch.zeros((max_seqs, graph_width), dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if copy_stream is not None else None

    def stage(self, step: FlatStep, padded: int | None = None) -> StepTensors:
        """Write `step` into the buffers and copy it to the device. `padded` (a decode graph's
        batch size, >= B): the decode step padded to that many rows (pad_decode), its tables
        gathered into `graph_tables`. Call on the compute stream; the result is unpadded."""
        num_tokens, num_seqs = len(step.input_ids), len(step.requests)
        size = num_seqs if padded is None else padded
        if num_tokens > self.max_tokens or size > self.max_seqs:
            raise ValueError(
                f"a step of {num_tokens} tokens over {num_seqs} sequences exceeds the buffers "
                f"for max_num_batched_tokens={self.max_tokens}, max_num_seqs={self.max_seqs}"
            )
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have read the staging
        self.input_ids.view[:num_tokens] = step.input_ids
        self.positions.view[:num_tokens] = step.positions
        self.slot_mapping.view[:num_tokens] = step.slots
        self.seq_lens.view[:num_seqs] = step.seq_lens
        self.query_start_loc.view[: num_seqs + 1] = step.query_start
        self.table_rows.view[:num_seqs] = step.table_rows
        if padded is not None:
            self.pad_decode(num_seqs, padded)
        num_samples = 0 if step.sample_index is None else len(step.sample_index)
        if num_samples:
            self.sample_index.view[:num_samples] = step.sample_index
        with self._on_copy_stream():
            ids = self.input_ids.send(max(num_tokens, size))
            positions = self.positions.send(max(num_tokens, size))
            slots = self.slot_mapping.send(max(num_tokens, size))
            seq_lens = self.seq_lens.send(size)
            query_start = self.query_start_loc.send(size + 1)
            rows = self.table_rows.send(num_seqs)
            sample_index = self.sample_index.send(num_samples) if num_samples else None
            self.tables.sync()
        if self.copied is not None:
            self.copied.record(self.copy_stream)
            torch.cuda.current_stream(self.device).wait_event(self.copied)
        if padded is None:
            table = self.tables.table[:, : step.width].index_select(0, rows)
        else:
            table = self.graph_tables[:num_seqs]
            torch.index_select(self.tables.table[:, : self.graph_width], 0, rows, out=table)
        meta = AttentionMetadata(
            slots[:num_tokens], table, seq_lens[:num_seqs], query_start[: num_seqs + 1]
        )
        return StepTensors(ids[:num_tokens], positions[:num_tokens], meta, sample_index)

    def pad_decode(self, start: int, end: int) -> None:
        """Host rows [start, end) of a decode step as padding: token 0 at position 0, slot -1
        (store_kv writes nothing), context length 1 (paged_attention requires >= 1: a row of
        no context would divide by an empty softmax) and one query each (query_start_loc goes
        on by one a row). Paged attention then reads, for a padded row, the first cache slot of
        its graph_tables row's first block, any valid block id, and its output is never used:
        in bounds, with no write to the cache and no effect on the real rows."""
        self.input_ids.view[start:end] = 0
        self.positions.view[start:end] = 0
        self.slot_mapping.view[start:end] = -1
        self.seq_lens.view[start:end] = 1
        first = int(self.query_start_loc.view[start])
        self.query_start_loc.view[start + 1 : end + 1] = np.arange(1, end - start + 1) + first

    def padding_only(self, size: int) -> AttentionMetadata:
        """A decode step of `size` padded rows alone, on the device (what graphs are captured
        and warmed up with): its metadata over the buffers' prefixes."""
        self.query_start_loc.view[0] = 0
        self.pad_decode(0, size)
        for staged in (self.input_ids, self.positions, self.slot_mapping, self.seq_lens):
            staged.send(size)
        self.query_start_loc.send(size + 1)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # before the staging is reused
        return self.decode_meta(size)

    def decode_meta(self, size: int) -> AttentionMetadata:
        """The metadata a decode graph of `size` rows reads: fixed prefixes of the buffers."""
        return AttentionMetadata(
            self.slot_mapping.device[:size],
            self.graph_tables[:size],
            self.seq_lens.device[:size],
            self.query_start_loc.device[: size + 1],
        )

    def _on_copy_stream(self):
        if self.copy_stream is None:
            return contextlib.nullcontext()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.copy_stream)
