"""Linear layers for a few rows at a time: a C kernel reading oneDNN's packed weight in place.

Why: a decode step with one or two sequences multiplies a couple of rows by every weight of
the model, so its matmuls should cost one pass over the weights. oneDNN (the path
``PackedLinear`` takes) is built for many rows. On the 2-core AMD EPYC development machine
the demo "large" model's 33 matmuls (~76 MB of float32 weights; ``x.sum()`` over as many
bytes takes 0.95-1.4 ms, depending on the neighbours) take 2.5-3.6 ms on oneDNN at 1-2
rows. ``kernels/csrc/linear_cpu.c`` streams each weight once, in storage order, and spends
every loaded weight on all rows: 1.2-2.2 ms at 1-2 rows, ~1.4-2.1 ms at 4, 2.2-2.6 at 8
and 3.6-4.0 at 16 (oneDNN 2.6-3.0, 3.6-3.9, 4.5-4.9), always the faster of the two, and
within ~10% of ``x.sum()`` on weights too large for the cache. A one-sequence decode step
of the whole engine goes from ~6.4 to ~4.0 ms.

What it reads: the buffer ``torch.ops.mkldnn._reorder_linear_weight`` packed, so the
native path costs no second copy of the weights. With AVX-512, oneDNN packs a float32
``[N, K]`` weight into blocks of 64 output features, each block k-major
(``[ceil(N/64), K16, 64]``, ``K16`` = K rounded up to 16; only ``N`` = 1 stays plain).
That layout is oneDNN's choice, not ours, so it is checked once per process on a small
weight of known values and per weight by the buffer's size; ``PackedLinear`` then probes
each layer through the kernel against ``F.linear``.

When it falls back: :func:`small_batch_linear` runs oneDNN on the same packed weight when
the native kernels are off (``TOLLWAY_CPU_KERNELS=reference``) or cannot be built, or the
input is not float32 or has more than :data:`MAX_ROWS` rows; :func:`blocked_weight` is
``None`` (nothing to run natively) when the native path is unavailable or a weight is not
float32 in the checked layout (bfloat16, another CPU's layout).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kernels.cpu_build import load_kernels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "linear_cpu.c"
_ABI_VERSION = 1
MAX_ROWS = 16  # the kernel's MAX_ROWS: more rows are oneDNN's
_BLOCK = 64  # output features per packed block (the kernel's BLOCK)
_K_ALIGN = 16  # oneDNN pads K to a multiple of this


@dataclass(frozen=True)
class BlockedWeight:
    """A float32 ``[out_features, in_features]`` weight as oneDNN packed it, in the layout
    the kernel reads: ``[ceil(out_features / 64), k_padded, 64]`` starting at ``address``."""

    packed: torch.Tensor  # the opaque oneDNN tensor: keeps the buffer alive
    address: int
    out_features: int
    in_features: int
    k_padded: int


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` when native kernels are off or cannot be built."""
    library = load_kernels(
        SOURCE,
        "linears stay on oneDNN",
        ("tollway_linear_abi_version", _ABI_VERSION),
        {
            "tollway_small_batch_linear": (
                [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int],
                ctypes.c_int,
            )
        },
    )
    if library is None:
        return None
    if library.tollway_linear_max_rows() != MAX_ROWS or library.tollway_linear_block() != _BLOCK:
        logger.warning("%s does not match this module; linears stay on oneDNN", SOURCE.name)
        return None
    return library


def is_available() -> bool:
    """The kernel is built and oneDNN packs float32 weights in the layout it reads."""
    return native_library() is not None and _onednn_packs_in_blocks()


def blocked_weight(packed: torch.Tensor) -> BlockedWeight | None:
    """``packed`` (from ``_reorder_linear_weight``) for the kernel, or ``None`` if it cannot
    read it: native path unavailable, not float32, or a buffer of another size."""
    if not is_available() or packed.dtype != torch.float32 or packed.dim() != 2:
        return None
    out_features, in_features = packed.shape
    k_padded = -(-in_features // _K_ALIGN) * _K_ALIGN
    num_blocks = -(-out_features // _BLOCK)
    if _packed_nbytes(packed) != num_blocks * k_padded * _BLOCK * 4:
        return None
    address = int(torch.ops.mkldnn.data_ptr(packed))
    return BlockedWeight(packed, address, out_features, in_features, k_padded)


def small_batch_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: BlockedWeight,
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    """``x @ W.T + bias``: the native kernel for up to ``MAX_ROWS`` float32 rows, else oneDNN."""
    library = native_library()
    num_rows, in_features = x.shape
    if in_features != weight.in_features:
        raise ValueError(f"x has {in_features} features, the weight takes {weight.in_features}")
    native_bias = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    if library is None or num_rows > MAX_ROWS or x.dtype != torch.float32 or not native_bias:
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    y = torch.empty((num_rows, weight.out_features), dtype=torch.float32)
    if num_rows == 0:
        return y
    x = x.contiguous()
    status = library.tollway_small_batch_linear(
        weight.address,
        x.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        num_rows,
        weight.out_features,
        in_features,
        weight.k_padded,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"small_batch_linear rejected a [{num_rows}, {in_features}] input")
    return y


def _packed_nbytes(packed: torch.Tensor) -> int:
    return int(torch.ops.mkldnn._nbytes(packed))


@cache
def _onednn_packs_in_blocks() -> bool:
    """oneDNN packs a float32 weight here the way the kernel reads it (checked on a weight of
    known values whose shape needs both kinds of padding)."""
    out_features, in_features = 2 * _BLOCK + 3, 2 * _K_ALIGN + 5
    weight = torch.arange(1, out_features * in_features + 1, dtype=torch.float32)
    weight = weight.view(out_features, in_features)  # exact: far below 2**24
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BLOCK)
        nbytes = _packed_nbytes(packed)
        address = int(torch.ops.mkldnn.data_ptr(packed))
    except (AttributeError, RuntimeError) as error:  # an op missing from this build
        logger.info("cannot read oneDNN's packed weights (%s); linears stay on oneDNN", error)
        return False
    k_padded = -(-in_features // _K_ALIGN) * _K_ALIGN
    num_blocks = -(-out_features // _BLOCK)
    if nbytes != num_blocks * k_padded * _BLOCK * 4:
        return False
    raw = (ctypes.c_float * (nbytes // 4)).from_address(address)
    got = torch.frombuffer(raw, dtype=torch.float32).view(num_blocks, k_padded, _BLOCK)
    want = torch.zeros(num_blocks * _BLOCK, k_padded)
    want[:out_features, :in_features] = weight
    want = want.view(num_blocks, _BLOCK, k_padded).transpose(1, 2)  # [block, k, j]
    used = want != 0  # the padding's contents are oneDNN's business
    return bool(torch.equal(got[used], want[used]))
