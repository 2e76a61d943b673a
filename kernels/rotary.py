"""Rotary position embedding applied to queries and keys: in place by a C kernel for float32
on the CPU, in PyTorch otherwise (Hugging Face's ``rotate_half`` convention, bit for bit).

``backend_engine.models.rotary`` computes the angles; this applies them. The PyTorch path is eight
ops and a new tensor per layer (~25 us for a 16-sequence decode step's q and k on the 2-core
development machine, ~45 us cold); ``kernels/csrc/rotary_cpu.c`` rotates the heads where the
q/k/v projection left them, in one pass. CUDA, other dtypes, layouts the kernel does not
take, no C compiler and ``TOLLWAY_CPU_KERNELS=reference`` run the PyTorch path.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.cpu_build import load_kernels

SOURCE = Path(__file__).parent / "csrc" / "rotary_cpu.c"
_ABI_VERSION = 1


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` when native kernels are off or cannot be built."""
    arguments = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    return load_kernels(
        SOURCE,
        "rotary embedding stays on PyTorch",
        ("tollway_rotary_abi_version", _ABI_VERSION),
        {"tollway_rotary_in_place": (arguments, None)},
    )


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: x itself when rotated in place
    """``x1*cos - x2*sin, x2*cos + x1*sin`` over the two halves of each head. May rotate
    ``x`` in place (the native path does): use the returned tensor."""
    library = native_library() if _kernel_takes(x, cos, sin) else None
    if library is None:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens:
        library.tollway_rotary_in_place(
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            num_tokens,
            num_heads,
            head_dim,
            x.stride(0),
            cos.stride(0),
            torch.get_num_threads(),
        )
    return x


def _kernel_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    num_tokens, _, head_dim = x.shape
    half_shape = (num_tokens, 1, head_dim // 2)
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (x, cos, sin))
        and head_dim % 2 == 0
        and x.stride(2) == 1
        and x.stride(1) == head_dim
        and cos.shape == half_shape
        and sin.shape == half_shape
        and cos.stride(2) == 1
        and sin.stride(2) == 1
        and cos.stride(0) == sin.stride(0)
    )
