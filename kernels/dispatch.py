"""Choose the kernel implementation for a tensor's device.

CUDA tensors go to ``kernels.triton_attention`` once that module exists; everything else
(and CUDA until then) runs the plain-PyTorch reference. The module is looked up once and
cached by the import system, so dispatch costs one attribute check per call.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import ModuleType

from kernels import reference

TRITON_MODULE = "kernels.triton_attention"


@cache
def _triton_module() -> ModuleType | None:
    if importlib.util.find_spec(TRITON_MODULE) is None:
        return None
    return importlib.import_module(TRITON_MODULE)


def implementation_for(is_cuda: bool) -> ModuleType:
    """The module providing ``store_kv`` and the paged-attention functions for a device.

    A CUDA implementation must expose the same three functions with the same signatures
    as :mod:`kernels.reference`.
    """
    if is_cuda:
        triton_module = _triton_module()
        if triton_module is not None:
            return triton_module
    return reference
