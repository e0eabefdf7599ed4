"""Large CPU tensors of the decode step (K/V cache, packed weight panels) sit on 2 MiB pages."""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch

from actorserve.kernels.cpu import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def smaps_kib(address: int, field: str = "AnonHugePages:") -> int:
    """`field` (AnonHugePages, Rss) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == field:
            return int(line.split()[1])
    return 0


def resident_mib(address: int, length: int) -> float:
    """MiB of [address, address + length) in memory now (mincore, page by page)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(address + length - start) // mmap.PAGESIZE)
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, pages * mmap.PAGESIZE, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector.raw) * mmap.PAGESIZE / (1 << 20)


def test_zeros_are_zeros_of_the_asked_shape_and_type():
    tensor = huge_pages.zeros((3, 5, 7), torch.float32)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.float32
    assert not tensor.any()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages"
)
def test_a_large_tensor_is_backed_by_huge_pages_once_used():
    tensor = huge_pages.zeros((16 << 20,), torch.float32)  # 64 MiB
    tensor.fill_(1.0)  # its pages are faulted in on first use
    first_whole_page = -(-tensor.data_ptr() // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    # the advised range is a mapping of its own (madvise splits the allocation's)
    assert smaps_kib(first_whole_page) >= 32 << 10  # at least half of it on 2 MiB pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("huge", [True, False])
def test_zeros_touch_no_page_until_used(huge):
    """A KV cache costs a start nothing: its zeros are the kernel's, page by page on first use,
    so a Worker (re)start does not fault in a GiB it has not used yet."""
    tensor = huge_pages.zeros((64, 1 << 20), torch.bfloat16, huge)  # 128 MiB
    assert smaps_kib(tensor.data_ptr() + tensor.nbytes // 2, "Rss:") == 0
    tensor[:4].fill_(1.0)  # the first 8 MiB
    assert 0 < smaps_kib(tensor.data_ptr(), "Rss:") <= 16 << 10
    assert tensor[:4].all() and not tensor[4:].any()


def test_a_tensor_not_asked_huge_is_not_advised(monkeypatch):
    """transparent_huge_pages=False: no madvise at all (the kernel's default decides)."""
    monkeypatch.setattr(huge_pages, "_madvise", lambda: pytest.fail("advised"))
    tensor = huge_pages.zeros((16 << 20,), torch.float32, huge=False)
    assert not tensor.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_populate_faults_pages_in_without_changing_a_byte():
    """What the Worker runs while idle on a KV cache in use: the range becomes resident, the
    values written before stay, the rest stays zero."""
    tensor = huge_pages.zeros((64, 1 << 20), torch.bfloat16)  # 128 MiB, 2 MiB a row
    tensor[3].fill_(2.0)
    if not huge_pages.populate(tensor, 0, 32 << 20):  # the first 16 rows
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    base = tensor.data_ptr()
    assert resident_mib(base, 32 << 20) == 32
    assert resident_mib(base + (34 << 20), 94 << 20) == 0  # what was not asked (a page's slack)
    assert (tensor[3] == 2.0).all() and not tensor[:3].any() and not tensor[4:].any()
    assert huge_pages.populate(tensor, 0, 1 << 40)  # clipped to the tensor
    assert resident_mib(base, 128 << 20) == 128
    assert huge_pages.populate(tensor, 1 << 40, 2 << 40)  # past its end: nothing to do
