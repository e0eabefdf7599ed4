"""Decode steps replayed from CUDA graphs, one graph per batch size, over the step buffers.

A step of decodes alone (one token per request) launches the same kernels at every step; on
CUDA each launch costs host time that a large model hides and a small one does not. So at start
the Worker records the decode forward once per batch size in `graph_batch_sizes` (1, 2, 4, 8,
then every 16 up to max_num_seqs, and max_num_seqs itself), largest first, in one memory pool
(the smaller graphs reuse the largest's intermediates: only one replays at a time). Each graph
reads fixed prefixes of the persistent step buffers (step_buffers.py) and writes a static
output buffer; a step of B decodes is padded to the next captured size P (StepBuffers.pad_decode
says why padded rows are harmless), its inputs written into the buffers, the graph of P
replayed, and the first B rows of the output used. Prefill and mixed steps run eagerly, as do
decode steps of more rows than any graph or of tables wider than the graphs' (never, when the
scheduler keeps to max_model_len).

Where there is nothing to record (the CPU tests' path), an EagerGraph stands in: capture
records nothing and replay runs the forward on the same buffers, so the padding and buffer
logic runs, and is tested, on any device.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from .step_buffers import StepBuffers


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes, ascending: nano-vllm's list (1, 2, 4, 8, 16, 32, ...), cut at
    max_num_seqs, which is always the last, so every decode step has a graph."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return [*sizes, max_num_seqs]


class EagerGraph:
    """A graph that records nothing: each replay runs the forward again."""

    def __init__(self, forward: Callable[[], None]):
        self.forward = forward

    def replay(self) -> None:
        self.forward()


class DecodeGraphs:
    """`record`: CUDA graphs; else EagerGraphs (the same buffers, padding and slicing)."""

    def __init__(self, model, kv_caches, buffers: StepBuffers, sizes: list[int], record: bool):
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        self.sizes, self.record = sizes, record
        self.graphs: dict[int, torch.cuda.CUDAGraph | EagerGraph] = {}
        self.hidden: torch.Tensor | None = None  # [max size, hidden]: every graph's output

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest captured size that holds `num_rows` rows; None past the largest."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self) -> None:
        """Record every size's graph, largest first (call in inference mode, on the stream the
        replays run on). Each is warmed up eagerly first, so that every kernel it launches is
        compiled before the capture; the buffers hold a padding-only step meanwhile, which
        writes nothing to the KV cache."""
        largest = self.sizes[-1]
        self.buffers.padding_only(largest)
        probe = self.model(*self._inputs(1))  # the hidden states' width and dtype
        self.hidden = torch.empty((largest, probe.shape[1]), dtype=probe.dtype, device=probe.device)
        pool = torch.cuda.graph_pool_handle() if self.record else None
        for size in reversed(self.sizes):
            forward = self._forward_of(size)
            if not self.record:
                self.graphs[size] = EagerGraph(forward)
                continue
            forward()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                forward()
            self.graphs[size] = graph
        if self.record:
            torch.cuda.synchronize(self.hidden.device)

    def replay(self, size: int) -> torch.Tensor:
        """Run graph `size` on what the buffers hold: the hidden states of all `size` rows (a
        view of the static output, valid until the next replay)."""
        self.graphs[size].replay()
        return self.hidden[:size]

    def _inputs(self, size: int):
        buffers = self.buffers
        ids, positions = buffers.input_ids.device[:size], buffers.positions.device[:size]
        return ids, positions, self.kv_caches, buffers.decode_meta(size)

    def _forward_of(self, size: int) -> Callable[[], None]:
        inputs, out = self._inputs(size), self.hidden[:size]

        def forward() -> None:
            out.copy_(self.model(*inputs))

        return forward
