"""Run the Triton kernels under Triton's interpreter when there is no GPU.

``TRITON_INTERPRET`` is set first (`tests.support.triton_interpreter`: before anything imports
triton); then this conftest mends the interpreter's bf16 ``tl.dot``. With CUDA
present nothing changes and the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os
from typing import Any

from tests.support.triton_interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _patch_interpreter_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` understand bfloat16 operands.

    The interpreter stores bfloat16 as raw ``uint16`` bits and its ``create_dot`` multiplies
    those bits as integers (Triton 3.x). Widening the bits to float32 first is exact, so the
    kernels' own bf16 rounding (e.g. of the probabilities) is still what gets tested.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(handle: Any) -> Any:
        if handle.dtype != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, *args: Any) -> Any:
        return original(self, widen(a), widen(b), *args)

    builder.create_dot = create_dot


if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16_dot()
