"""Linear layers over GGUF's quantized blocks as stored: ``y = x @ W.T`` with W never widened.

Why: a GGUF file's Q8_0 / Q4_0 / Q4_1 weights are 3.8-7.1x smaller than float32, and a decode
step's matmuls cost one pass over the weights. ``kernels/csrc/quant_linear_cpu.c`` reads the
blocks in place (its header gives the three layouts) for decode and prefill alike.

Two methods (:class:`QuantLinearMethod`), both in the kernel:

- ``DECODE_TO_FLOAT``: each block decoded to floats and FMA'd with x; the dequantized
  matmul up to summation order.
- ``INT8_ACTIVATIONS`` (the default): x rounded to int8 per block of 32 (scale
  ``max|x| / 127``, llama.cpp's Q8_0 activations) and integer dot products (VNNI where the
  compiler targets it: the library is built with -march=native per processor model, so
  that is a check of this CPU). Its result is ``W @ x_hat`` up to float rounding, x_hat
  being x on its int8 grid, so ``|y - W @ x| <= |W| @ (max|x_block| / 254)`` per element
  plus rounding.
  Measured on the 2-core AMD EPYC (Zen 4, AVX-512 VNNI) development machine, SmolLM2-135M's
  shapes (N, K in 192-1536 x 576-1536), against float32 ``torch.matmul`` of the dequantized
  weight (``python -m bench.quant_linear``; a shared machine, so rough): one row (decode),
  1.5-2.6x faster at 576-1536 outputs and even at 192; 256 rows (prefill), 0.9-1.25x the
  matmul's time, with 4-7x less weight memory. ``DECODE_TO_FLOAT`` took 2.6-3.2x the matmul's
  time at one row and 3.2-4.4x at 256: the decode costs more than the load it saves.

When it falls back: with native kernels off (``TOLLWAY_CPU_KERNELS=reference``) or unbuildable,
:func:`quantized_linear` dequantizes with :func:`dequantize` and runs ``torch.matmul``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from enum import IntEnum
from functools import cache
from pathlib import Path

import torch

from kernels.cpu_build import load_kernels

SOURCE = Path(__file__).parent / "csrc" / "quant_linear_cpu.c"
_ABI_VERSION = 1
BLOCK_VALUES = 32  # values per block, every supported type


class GGUFQuantType(IntEnum):
    """The supported block types, by ggml's type id (``gguf.GGMLQuantizationType``)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8


BLOCK_BYTES = {GGUFQuantType.Q4_0: 18, GGUFQuantType.Q4_1: 20, GGUFQuantType.Q8_0: 34}


class QuantLinearMethod(IntEnum):
    """How the kernel spends a block (values are the C kernel's)."""

    DECODE_TO_FLOAT = 0
    INT8_ACTIVATIONS = 1


DEFAULT_METHOD = QuantLinearMethod.INT8_ACTIVATIONS


@dataclass(frozen=True)
class GGUFBlockWeight:
    """A ``[out_features, in_features]`` weight as GGUF stores it: ``blocks`` is uint8
    ``[out_features, in_features // 32 * block bytes]``, each row its blocks in k order."""

    blocks: torch.Tensor
    quant_type: GGUFQuantType
    out_features: int
    in_features: int

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, quant_type: int) -> GGUFBlockWeight:
        """``blocks`` checked for the kernel: raises ``ValueError`` naming what is wrong."""
        try:
            kind = GGUFQuantType(quant_type)
        except ValueError:
            raise ValueError(f"ggml type {quant_type} is not one of Q4_0, Q4_1, Q8_0") from None
        if blocks.dtype != torch.uint8 or blocks.dim() != 2:
            raise ValueError(
                f"blocks must be a 2-D uint8 tensor, got {blocks.dtype} {blocks.dim()}-D"
            )
        out_features, row_bytes = blocks.shape
        if out_features < 1 or row_bytes < 1 or row_bytes % BLOCK_BYTES[kind] != 0:
            raise ValueError(
                f"a {kind.name} row is whole blocks of {BLOCK_BYTES[kind]} bytes, got {row_bytes}"
            )
        in_features = row_bytes // BLOCK_BYTES[kind] * BLOCK_VALUES
        return cls(blocks.contiguous(), kind, out_features, in_features)


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` when native kernels are off or cannot be built."""
    return load_kernels(
        SOURCE,
        "quantized linears dequantize and run torch.matmul",
        ("tollway_quant_linear_abi_version", _ABI_VERSION),
        {
            "tollway_quant_linear": (
                [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                + [ctypes.c_int64] * 3
                + [ctypes.c_int, ctypes.c_int],
                ctypes.c_int,
            ),
            "tollway_quant_linear_int8_isa": ([], ctypes.c_int),
        },
    )


def is_available() -> bool:
    return native_library() is not None


def int8_instruction_set() -> str | None:
    """What ``INT8_ACTIVATIONS`` runs on here ("vnni", "avx2" or "plain C"; ``None`` with no
    native kernel): without VNNI it loses much of its lead, which the caller may weigh."""
    library = native_library()
    if library is None:
        return None
    return ("plain C", "avx2", "vnni")[library.tollway_quant_linear_int8_isa()]


def quantized_linear(
    x: torch.Tensor,  # [num_rows, in_features] float32
    weight: GGUFBlockWeight,
    method: QuantLinearMethod = DEFAULT_METHOD,
    num_threads: int | None = None,
) -> torch.Tensor:  # [num_rows, out_features] float32
    """``x @ W.T`` over the stored blocks: the native kernel, else dequantize + matmul.
    ``num_threads`` defaults to PyTorch's; the result does not depend on it."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [rows, {weight.in_features}], got {list(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    library = native_library()
    if library is None:
        return x @ dequantize(weight).T
    num_rows = x.shape[0]
    y = torch.empty((num_rows, weight.out_features), dtype=torch.float32)
    if num_rows == 0:
        return y
    x = x.contiguous()
    status = library.tollway_quant_linear(
        weight.blocks.data_ptr(),
        int(weight.quant_type),
        x.data_ptr(),
        y.data_ptr(),
        num_rows,
        weight.out_features,
        weight.in_features,
        int(method),
        num_threads or torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"quantized_linear rejected a [{num_rows}, {weight.in_features}] input")
    return y


def dequantize(weight: GGUFBlockWeight) -> torch.Tensor:  # [out_features, in_features]
    """The weight as float32 (the fallback's path; ``gguf``'s dequantize is the referee)."""
    num_blocks = weight.out_features * weight.in_features // BLOCK_VALUES
    raw = weight.blocks.reshape(num_blocks, BLOCK_BYTES[weight.quant_type])
    d = raw[:, 0:2].contiguous().view(torch.float16).float()  # [num_blocks, 1]
    if weight.quant_type == GGUFQuantType.Q8_0:
        values = raw[:, 2:].contiguous().view(torch.int8).float() * d
    else:
        packed = raw[:, 4:] if weight.quant_type == GGUFQuantType.Q4_1 else raw[:, 2:]
        nibbles = torch.cat((packed & 15, packed >> 4), dim=1).float()  # [num_blocks, 32]
        if weight.quant_type == GGUFQuantType.Q4_0:
            values = (nibbles - 8) * d
        else:
            values = d * nibbles + raw[:, 2:4].contiguous().view(torch.float16).float()
    return values.reshape(weight.out_features, weight.in_features)
