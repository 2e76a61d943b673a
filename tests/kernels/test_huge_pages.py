"""Huge-page memory for the tensors a decode step streams (kernels.huge_pages)."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from kernels import huge_pages
from kernels.huge_pages import (
    HUGE_PAGE_BYTES,
    copies_on_huge_pages,
    huge_page_bytes,
    huge_page_empty,
    release_freed_memory,
)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE)")


def test_memory_starts_on_a_huge_page_boundary_zeroed() -> None:
    buffer = huge_page_bytes(3 * HUGE_PAGE_BYTES + 5)
    assert buffer.dtype == torch.uint8
    assert buffer.numel() == 3 * HUGE_PAGE_BYTES + 5
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(buffer.count_nonzero()) == 0
    buffer.fill_(7)  # writable, private
    assert int(buffer[-1]) == 7


def test_a_typed_tensor_has_its_shape_and_dtype() -> None:
    cache = huge_page_empty((4, 16, 3, 64), torch.float32)
    assert cache.shape == (4, 16, 3, 64)
    assert cache.dtype == torch.float32
    assert cache.is_contiguous()
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(cache.count_nonzero()) == 0
    assert huge_page_empty((0, 3), torch.int8).shape == (0, 3)


@linux_only
def test_the_mapping_is_advised_to_use_huge_pages() -> None:
    """The kernel records the advice (VmFlags 'hg') whether or not THP is enabled."""
    buffer = huge_page_bytes(4 * HUGE_PAGE_BYTES)
    buffer.fill_(1)
    start = buffer.data_ptr()
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for index, line in enumerate(lines):
        low, _, high = line.split()[0].partition("-")
        if "-" in line.split()[0] and int(low, 16) <= start < int(high, 16):
            flags = next(entry for entry in lines[index:] if entry.startswith("VmFlags"))
            assert " hg" in flags
            return
    pytest.fail("the mapping is not in /proc/self/smaps")


def test_copies_hold_the_same_values_each_on_a_cache_line() -> None:
    tensors = [
        torch.arange(1000, dtype=torch.uint8).reshape(10, 100),
        torch.randn(7, 3),
        torch.arange(5, dtype=torch.int64),
        torch.empty(0, dtype=torch.float32),
    ]
    copies = copies_on_huge_pages(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype
        assert copy.shape == tensor.shape
        assert torch.equal(copy, tensor)
        assert copy.data_ptr() != tensor.data_ptr() or tensor.numel() == 0
    assert all(copy.data_ptr() % 64 == 0 for copy in copies)
    assert copies[0].data_ptr() % HUGE_PAGE_BYTES == 0  # the first starts the mapping
    copies[1].zero_()  # copies, not views
    assert int(tensors[1].count_nonzero()) > 0


def test_only_contiguous_cpu_tensors_are_copied() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        copies_on_huge_pages([torch.randn(4, 4).T])


def test_without_private_mappings_the_memory_is_ordinary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(mmap, "MAP_PRIVATE", raising=False)
    buffer = huge_pages.huge_page_bytes(1000)
    assert buffer.numel() == 1000
    assert int(buffer.count_nonzero()) == 0


def test_releasing_freed_memory_is_harmless() -> None:
    release_freed_memory()
