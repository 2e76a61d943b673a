"""Process-wide tuning for the CPU path: denormals, malloc and oneDNN's caches.

Denormal floats (below ~1e-38) take a slow microcode path on x86: a model whose
activations drift there runs several times slower for no gain in accuracy, so
they are flushed to zero.

Malloc: the CPU attention reference gathers each sequence's KV blocks into fresh
buffers every step. With glibc's defaults those large buffers are mmapped and
returned to the OS on free, so every step page-faults them in again; raising
the mmap and trim thresholds keeps them in the heap and roughly halves the
decode step time. It only affects this process.

oneDNN's caches: the packed linears (``models/packed_linear.py``) run on oneDNN above a few
rows, and oneDNN keeps what it builds for each (weight shape, row count) in two caches,
oneDNN's primitive cache and PyTorch's ideep LRU, 1024 entries each by default. Every step
with a batch size not seen before adds entries (~0.4 MB each for the small demo model's
shapes), so the engine's memory grew with every new batch size until the caches were
full: +427 MB for the demo model's five weight shapes, 119 MB in the first minute of a
100-stream load. Both are bounded here to ``ONEDNN_CACHE_CAPACITY`` entries (+27 MB),
unless the environment sets them: a row count seen again within the last few steps (a
steady decode batch, full prefill chunks) still hits, and a miss costs about as much as
one more call of that layer. The variables are read when oneDNN first runs, so this must
happen before the model is packed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD_BYTES = 1 << 30
ONEDNN_CACHE_CAPACITY = 64  # entries in each of oneDNN's two caches (defaults: 1024)
_ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


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


def bound_onednn_caches() -> None:
    """Cap oneDNN's per-shape caches (see the module docstring) unless the environment
    already does; takes effect only before oneDNN first runs in this process."""
    for name in _ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


def tune_cpu_runtime() -> None:
    """Flush denormals to zero, keep large buffers in the heap and bound oneDNN's caches
    (this process only)."""
    bound_onednn_caches()
    torch.set_flush_denormal(True)
    keep_large_buffers_in_heap()
