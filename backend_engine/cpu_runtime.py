"""Process-wide tuning for the CPU path: denormals and malloc.

Denormal floats (below ~1e-38) take a slow microcode path on x86: a model whose
activations drift there runs several times slower for no gain in accuracy, so
they are flushed to zero.

Malloc: the CPU attention reference gathers each sequence's KV blocks into fresh
buffers every step. With glibc's defaults those large buffers are mmapped and
returned to the OS on free, so every step page-faults them in again; raising
the mmap and trim thresholds keeps them in the heap and roughly halves the
decode step time. It only affects this process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD_BYTES = 1 << 30


def keep_large_buffers_in_heap() -> bool:
    """Tune glibc's malloc if it is the allocator; returns whether it applied."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    applied = bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _THRESHOLD_BYTES)
    )
    if not applied:
        logger.debug("mallopt refused the thresholds; leaving malloc as it is")
    return applied


def tune_cpu_runtime() -> None:
    """Flush denormals to zero and keep large buffers in the heap (this process only)."""
    torch.set_flush_denormal(True)
    keep_large_buffers_in_heap()
