"""Choose the kernel implementation for a tensor's device.

CUDA tensors go to ``kernels.triton_attention`` (the Triton kernels); CPU tensors go to
``kernels.cpu_attention`` (a native decode kernel with the PyTorch reference behind it).
Modules are looked up once and cached, so dispatch costs one attribute check per call.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import ModuleType

from kernels import cpu_attention, reference

TRITON_MODULE = "kernels.triton_attention"


@cache
def _triton_module() -> ModuleType | None:
    if importlib.util.find_spec(TRITON_MODULE) is None:
        return None
    return importlib.import_module(TRITON_MODULE)


# The Triton kernels need head_dim to be a power of two at least this large (tl.dot).
MIN_TRITON_HEAD_DIM = 16


def implementation_for(is_cuda: bool, head_dim: int = 64) -> ModuleType:
    """The module providing ``store_kv`` and the paged-attention functions for a device.

    A CUDA implementation must expose the same three functions with the same signatures
    as :mod:`kernels.reference`. Head sizes the Triton kernels cannot tile (e.g. 80 or 96)
    fall back to the reference, which is slower on a GPU but exact.
    """
    if not is_cuda:
        return cpu_attention
    is_tileable = head_dim >= MIN_TRITON_HEAD_DIM and head_dim & (head_dim - 1) == 0
    if is_tileable:
        triton_module = _triton_module()
        if triton_module is not None:
            return triton_module
    return reference
