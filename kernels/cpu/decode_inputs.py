"""A step of decodes' flat inputs, written in C (csrc/cpu_step_inputs.c) into buffers that the
step's tensors view, so a step that reuses them makes no arrays (actors/worker/decode_batch.py
keeps one per run of steps over the same decodes)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch


class DecodeInputs:
    """A step of decodes' flat inputs (see cpu_step_inputs.c) from `requests` [n, 4] int64
    C-contiguous (tokens computed, blocks held, block table row, the token at that position),
    for requests of at most `columns` blocks: buffers, and the torch tensors viewing them
    (input_ids, positions, slots [n] int64; seq_lens [n], query_start_loc [n + 1], tables
    [n, width] int32, rows `columns` apart). `fill` rewrites them in place, so a step that reuses
    the object makes no arrays; the pointers are taken once (each `.ctypes` call is slow on the
    cold caches a step leaves)."""

    def __init__(self, lib: ctypes.CDLL, requests: np.ndarray, columns: int):
        n = requests.shape[0]
        self._lib = lib
        self.n, self.columns, self.width = n, columns, 0
        self._requests = requests  # kept alive: the C call writes to it through the pointer
        self._requests_data = requests.ctypes.data
        self._table: np.ndarray | None = None
        self._table_data = 0
        self._out64 = np.empty(3 * n, dtype=np.int64)
        self._out32 = np.empty(n * columns + 2 * n + 1, dtype=np.int32)
        out64, out32 = torch.from_numpy(self._out64), torch.from_numpy(self._out32)
        self.input_ids, self.positions, self.slots = out64[:n], out64[n : 2 * n], out64[2 * n :]
        self._all_tables = out32[: n * columns].view(n, columns)
        self.tables = self._all_tables[:, :0]
        self.seq_lens = out32[n * columns : n * columns + n]
        self.query_start_loc = out32[n * columns + n :]
        p64, p32 = self._out64.ctypes.data, self._out32.ctypes.data
        self._outputs = (
            p64, p64 + 8 * n, p64 + 16 * n, p32, columns, p32 + 4 * n * columns,
            p32 + 4 * (n * columns + n),
        )  # fmt: skip

    def fill(
        self,
        table: np.ndarray,
        block_size: int,
        next_tokens: torch.Tensor | None = None,
    ) -> int | None:
        """table [rows, columns] int32 C-contiguous -> None, or the index of the first request
        whose token lies past its blocks (the outputs are then invalid). next_tokens [n] int64
        contiguous: each request first moves on by that token (one more computed, the token its
        next), in `requests` too."""
        if table.shape[1] > self.columns:
            raise ValueError(f"a block table of {table.shape[1]} columns in {self.columns}")
        if table is not self._table:  # the block tables grew a new array
            self._table, self._table_data = table, table.ctypes.data
        status = self._lib.decode_inputs(
            self._requests_data, self.n, self._table_data, table.shape[1], block_size,
            *self._outputs, None if next_tokens is None else next_tokens.data_ptr(),
        )  # fmt: skip
        if status < 0:
            return -1 - status
        if status != self.width:
            self.width, self.tables = status, self._all_tables[:, :status]
        return None
