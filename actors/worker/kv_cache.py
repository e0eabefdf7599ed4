"""The paged KV cache the Worker owns: per layer K and V [num_blocks, block_size, Hkv, D] on the
device, plus an optional swap space of the same shape in (pinned, on CUDA) host memory.

Swaps run on the Worker's copy stream: swap-outs (device -> host) first, then swap-ins (host ->
device), all before the step's forward, which waits on an event. The copy stream first waits for
the compute stream: a swap-out reads blocks the last forward may still be writing (store_kv), and
a swap-in writes blocks (freed since) that it may still be reading.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ...kernels.cpu import huge_pages


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ):
        """`allocate(shape, dtype)`: zeroed device blocks where a backend places them itself (the
        CPU fast path: on huge pages, none of them touched yet, see `prefault`); else
        torch.zeros on `device`."""
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.untouched = allocate is not None  # pages the first write would fault in
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def zeros():
            if allocate is not None:
                return allocate(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.layers = [(zeros(), zeros()) for _ in range(num_layers)]
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.cpu_layers = (
            [
                (
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                )
                for _ in range(num_layers)
            ]
            if num_cpu_blocks
            else []
        )
        self.device = device

    def prefault(self, chunk_bytes: int = huge_pages.HUGE_PAGE) -> Iterator[None]:
        """Fault in the pages of a cache `allocate` left untouched, ahead of the steps that would
        otherwise pay for them, without writing a byte (huge_pages.populate): `chunk_bytes` of
        every layer's K and V at a time, lowest blocks first (the BlockManager hands blocks out
        lowest first), yielding after each chunk so that the caller can run a step between
        two. Yields nothing where there is nothing to fault in or the kernel cannot."""
        if not self.untouched or not self.layers:
            return
        cache_bytes = self.layers[0][0].numel() * self.layers[0][0].element_size()
        for start in range(0, cache_bytes, chunk_bytes):
            for k, v in self.layers:
                for cache in (k, v):
                    if not huge_pages.populate(cache, start, start + chunk_bytes):
                        return
            yield
        self.untouched = False

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks (src, dst) in every layer: copy-on-write of forked samples. Runs on
        the current (compute) stream, after the swaps and before the forward."""
        if pairs:
            _copy_blocks(self.layers, pairs)

    def swap(
        self,
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Copy (device block, host block) pairs out, then (host block, device block) pairs in.
        With a `stream`: on it, ordered after the current (compute) stream's work so far, and
        the current stream waits for the copies."""
        if not swap_out and not swap_in:
            return
        if swap_out and not self.cpu_layers:
            raise RuntimeError("swap_out without swap space (num_cpu_blocks is 0)")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            for (k, v), (k_cpu, v_cpu) in zip(self.layers, self.cpu_layers):
                for src, dst in ((k, k_cpu), (v, v_cpu)):
                    if swap_out:
                        gpu, cpu = _index(swap_out)
                        dst.index_copy_(0, cpu, src.index_select(0, gpu.to(src.device)).cpu())
                    if swap_in:
                        cpu, gpu = _index(swap_in)
                        rows = dst.index_select(0, cpu).to(src.device, non_blocking=True)
                        src.index_copy_(0, gpu.to(src.device), rows)
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(self.device).wait_event(done)


def _copy_blocks(layers, pairs: list[tuple[int, int]]) -> None:
    src, dst = _index(pairs)
    for k, v in layers:
        for cache in (k, v):
            cache.index_copy_(0, dst.to(cache.device), cache.index_select(0, src.to(cache.device)))


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = zip(*pairs)
    return torch.tensor(first, dtype=torch.long), torch.tensor(second, dtype=torch.long)
