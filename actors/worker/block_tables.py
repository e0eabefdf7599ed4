"""The persistent batch's block tables: one row of a 2-D int32 array per request in the batch.

A request keeps its row while it stays in the Worker's batch; a StepPlan's new block ids are
written once, at the end of its row, and a step's tables are one gather of the scheduled rows
(numpy fancy indexing), not a copy per request. Both dimensions grow by doubling. A released
row is zeroed, so the columns past a request's own blocks always hold block 0 (a valid id,
which the attention kernels mask by sequence length).

A device copy of the tables (step_buffers.DeviceBlockTables) follows them by deltas: the rows
written or released since its last look (`take_changes`), or the whole table after a clear or a
growth, which moves every row.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, rows: int = 64, columns: int = 32):
        self.table = np.zeros((rows, columns), dtype=np.int32)
        self.changed: set[int] = set()  # rows written or released since take_changes
        self.moved = True  # cleared or grown since take_changes: every row counts as changed
        self.clear()

    def take_row(self) -> int:
        if not self.free_rows:
            rows, columns = self.table.shape
            grown = np.zeros((2 * rows, columns), dtype=np.int32)
            grown[:rows] = self.table
            self.table = grown
            self.moved = True
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def release(self, row: int, num_blocks: int) -> None:
        self.table[row, :num_blocks] = 0
        self.free_rows.append(row)
        self.changed.add(row)

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Set columns [start, start + len(block_ids)) of the row."""
        end = start + len(block_ids)
        rows, columns = self.table.shape
        if end > columns:
            grown = np.zeros((rows, max(end, 2 * columns)), dtype=np.int32)
            grown[:, :columns] = self.table
            self.table = grown
            self.moved = True
        self.table[row, start:end] = block_ids
        self.changed.add(row)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """The tables of `rows`, in that order: a new [len(rows), width] array."""
        return self.table[rows, :width]

    def take_changes(self) -> list[int] | None:
        """The rows written or released since the last call, ascending; None when the table was
        cleared or grew since (a copy must take it whole). Either way the record starts over."""
        moved, changed = self.moved, self.changed
        self.moved, self.changed = False, set()
        return None if moved else sorted(changed)

    def clear(self) -> None:
        """Every row free and zeroed; pop() hands out the lowest first."""
        self.table[:] = 0
        self.free_rows = list(range(self.table.shape[0] - 1, -1, -1))
        self.changed.clear()
        self.moved = True
