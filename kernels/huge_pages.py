"""CPU memory on transparent huge pages (2 MiB), for the tensors a decode step streams.

One decoding sequence reads every weight and its whole KV context each step. On 4 KiB pages
that is a TLB miss every 4 KiB (~25,000 a token for SmolLM2-135M's 105 MB), each a page walk,
nested under a virtual machine's own; and the hardware prefetcher stops at every page
boundary. PyTorch's CPU allocator asks for huge pages only with ``THP_MEM_ALLOC_ENABLE=1``
in the environment, and most kernels here are set to ``madvise`` (huge pages only where
asked). So the weights and the KV cache are placed in anonymous private mappings advised
``MADV_HUGEPAGE`` and aligned to 2 MiB: a 100 MB streaming read measured 1.1-1.6x faster
on them on the 2-core development VM (``python -m bench.single_stream_decode`` times a
decode step on both).

Where huge pages are not available (not Linux, THP off or ``never``, no memory to compact)
the mappings are ordinary pages: nothing fails, nothing changes but the speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20
_ALIGNMENT = 64  # each tensor starts on a cache line


def huge_page_bytes(num_bytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of ``num_bytes`` on 2 MiB-aligned memory advised to use huge
    pages (an ordinary tensor where the platform has no such mappings). The tensor keeps
    its mapping alive."""
    if num_bytes <= 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(max(num_bytes, 0), dtype=torch.uint8)
    # Private, not the default shared mapping: shared anonymous memory is shmem, whose huge
    # pages follow shmem_enabled (usually never).
    mapping = mmap.mmap(
        -1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # THP compiled out: ordinary pages
            mapping.madvise(advice)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start : start + num_bytes]


def huge_page_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous tensor of ``shape`` and ``dtype`` on huge pages."""
    numel = 1
    for size in shape:
        numel *= size
    item = torch.empty((), dtype=dtype).element_size()
    return huge_page_bytes(numel * item).view(dtype).view(*shape)


def copies_on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU ``tensors``, one after another (each on a cache line) in one
    huge-page mapping; the mapping lives as long as any copy."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("only contiguous CPU tensors are copied to huge pages")
    sizes = [t.numel() * t.element_size() for t in tensors]
    spans = [-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes]
    arena = huge_page_bytes(sum(spans))
    copies: list[torch.Tensor] = []
    offset = 0
    for tensor, size, span in zip(tensors, sizes, spans, strict=True):
        copy = arena[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        copies.append(copy.copy_(tensor))
        offset += span
    return copies


def release_freed_memory() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``; nothing
    elsewhere). After a large copy the old buffers, freed, can stay in the heap and in the
    resident set: on SmolLM2-135M's blocks, ~150 MB."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)
