"""Large CPU tensors of the decode step (K/V cache, packed weight panels) sit on 2 MiB pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actorserve.kernels.cpu import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_zeros_are_zeros_of_the_asked_shape_and_type():
    tensor = huge_pages.zeros((3, 5, 7), torch.float32)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.float32
    assert not tensor.any()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages"
)
def test_a_large_tensor_is_backed_by_huge_pages():
    tensor = huge_pages.zeros((16 << 20,), torch.float32)  # 64 MiB
    first_whole_page = -(-tensor.data_ptr() // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    # the advised range is a mapping of its own (madvise splits the allocation's)
    assert anon_huge_kib(first_whole_page) >= 32 << 10  # at least half of it on 2 MiB pages


def test_a_tensor_not_asked_huge_is_not_advised(monkeypatch):
    """transparent_huge_pages=False: no madvise at all (the kernel's default decides)."""
    monkeypatch.setattr(huge_pages, "_madvise", lambda: pytest.fail("advised"))
    tensor = huge_pages.zeros((16 << 20,), torch.float32, huge=False)
    assert not tensor.any()
