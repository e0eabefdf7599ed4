"""Back large CPU tensors with 2 MiB pages (Linux transparent huge pages, `madvise` mode).

A decode step streams every running sequence's K/V and every weight once: ~130 MB on the demo
checkpoint, some 32k pages of 4 KiB, each a TLB miss and a page walk. On 2 MiB pages the same
bytes are ~65 TLB entries. The kernel hands out huge pages only where asked (`madvise` mode, the
default here) and only on first touch, so a tensor is advised while empty and filled after.
How much it saves depends on how the host backs the guest's memory, so it is a setting:
EngineConfig.transparent_huge_pages=False leaves every tensor on small pages (for A/B runs).

`zeros` (the KV cache) touches nothing: its memory is a private anonymous mapping, which the
kernel fills with zeros page by page as it is first used. Writing the zeros at start would fault
in every page of a cache most of which a fresh server does not use yet (a GiB on CPU by
default): seconds of every Worker start and restart, more where the kernel has to compact
memory into huge pages first. Left to the steps, a page would be paid for when a step first
writes to it, inside that step: a huge page's fault (zeroing 2 MiB, and compacting memory
first under the usual `defrag=madvise`) costs milliseconds, so a fresh server's prefills would
spend a tenth of their time in faults and its decodes stall where they cross into new pages.
So `populate` faults pages in ahead of use without writing them (MADV_POPULATE_WRITE), and the
Worker calls it, a page at a time, while it has no step to run (actors/worker/kv_cache.py
`KVCache.prefault`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, contents kept


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB-aligned pages are advised huge where `huge`
    (best effort: a kernel without THP, or a tensor under 2 MiB, just gets small pages)."""
    tensor = torch.empty(shape, dtype=dtype)
    if huge:
        _advise(tensor)
    return tensor


def zeros(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A zero CPU tensor none of whose pages is touched yet (the module docstring), advised
    huge where `huge`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(memory, dtype=dtype).view(shape)  # holds `memory` alive
    if huge:
        _advise(tensor)
    return tensor


def _advise(tensor: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) the whole 2 MiB pages of `tensor`'s memory (best effort)."""
    madvise = _madvise()
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if madvise is not None and last > first:
        madvise(first, last - first, MADV_HUGEPAGE)


def populate(tensor: torch.Tensor, start: int, end: int) -> bool:
    """Fault in bytes [start, end) of `tensor`'s memory (offsets into it, clipped to it) as a
    write would, without changing a byte: safe while the tensor is in use. False where the
    kernel cannot (not Linux, before 5.14), and then nothing was done."""
    madvise = _madvise()
    if madvise is None:
        return False
    base = tensor.data_ptr()
    first = (base + max(0, start)) // mmap.PAGESIZE * mmap.PAGESIZE
    last = base + min(end, tensor.numel() * tensor.element_size())
    return last <= first or madvise(first, last - first, MADV_POPULATE_WRITE) == 0
