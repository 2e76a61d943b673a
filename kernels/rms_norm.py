"""RMSNorm, fused with the residual add before it: a C kernel for float32 on the CPU.

A decoder layer normalises right after adding each sublayer's output to the residual
stream. ``F.rms_norm`` plus the add cost 10-60 us for 1-64 rows of 512 features on the
2-core development machine, ~17 times per decode step; ``kernels/csrc/rms_norm_cpu.c`` does
the add, the sum of squares and the scaling in two passes over each row. Anything else
(CUDA, other dtypes, non-contiguous tensors, no C compiler, or
``TOLLWAY_CPU_KERNELS=reference``) runs the same arithmetic in PyTorch, as Hugging Face's
``LlamaRMSNorm`` does (for bfloat16 and float16: the add in that dtype, the norm in float32,
rounded before the weight).

    normed, residual = add_rms_norm(x, residual, weight, eps)   # residual += x, in place
    normed = rms_norm(x, weight, eps)
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu_build import load_kernels

SOURCE = Path(__file__).parent / "csrc" / "rms_norm_cpu.c"
_ABI_VERSION = 1


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` when native kernels are off or cannot be built."""
    arguments = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    return load_kernels(
        SOURCE,
        "RMSNorm stays on PyTorch",
        ("tollway_norm_abi_version", _ABI_VERSION),
        {"tollway_add_rms_norm": (arguments, None)},
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * weight / sqrt(mean(x^2) + eps)`` over the last dimension of ``[rows, hidden]``."""
    library = _library_for(x, weight)
    if library is None:
        return _reference(x, weight, eps)
    out = torch.empty_like(x)
    _run(library, out, x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` (the new residual; written into ``residual`` on the native path) and
    its RMSNorm."""
    library = _library_for(x, weight, residual)
    if library is None:
        residual = residual + x
        return _reference(residual, weight, eps), residual
    out = torch.empty_like(x)
    _run(library, out, residual, x, weight, eps)
    return out, residual


def _library_for(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> ctypes.CDLL | None:
    """The kernel, if it takes these: float32 CPU tensors, contiguous, ``x`` (and the
    residual) ``[rows, hidden]``, the weight ``[hidden]``."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    usable = (
        x.dim() == 2
        and weight.shape == (x.shape[1],)
        and (residual is None or residual.shape == x.shape)
        and all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            for t in tensors
        )
    )
    return native_library() if usable else None


def _run(
    library: ctypes.CDLL,
    out: torch.Tensor,
    residual: torch.Tensor,
    addend: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> None:
    rows, hidden = residual.shape
    library.tollway_add_rms_norm(
        out.data_ptr(),
        residual.data_ptr(),
        None if addend is None else addend.data_ptr(),
        weight.data_ptr(),
        rows,
        hidden,
        eps,
        torch.get_num_threads(),
    )


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
