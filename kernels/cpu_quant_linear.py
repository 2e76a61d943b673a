"""Linear layers over GGUF's quantized blocks as stored: ``y = x @ W.T`` with W never widened.

Why: a GGUF file's quantized weights are 3.8-7.1x smaller than float32, and a decode step's
matmuls cost one pass over the weights. ``kernels/csrc/quant_linear_cpu.c`` reads the blocks in
place (its header gives the layouts) for decode and prefill alike: Q8_0, Q4_0, Q4_1, Q5_0 and
Q5_1 (blocks of 32 values) and the super-block types Q4_K, Q5_K and Q6_K (256 values, so their
in_features must be a multiple of 256; llama.cpp's files fall back to another type where not).

Three methods (:class:`QuantLinearMethod`), all in the kernel:

- ``DECODE_TO_FLOAT``: each block decoded to floats and FMA'd with x; the dequantized
  matmul up to summation order.
- ``INT8_ACTIVATIONS``: x rounded to int8 per block of 32 (scale ``max|x| / 127``,
  llama.cpp's Q8_0 activations) and integer dot products (VNNI where the compiler targets
  it: the library is built with -march=native per processor model, so that is a check of
  this CPU). Its result is ``W @ x_hat`` up to float rounding, x_hat being x on its int8
  grid, so ``|y - W @ x| <= |W| @ (max|x_block| / 254)`` per element plus rounding.
- ``INT8_SPLIT_ACTIVATIONS`` (the default): x = hi + lo, both int8 blocks (lo rounds what hi
  left over on a grid 256 times finer), two integer dot products per block sharing one read
  of W and summed as one integer, ``hi * 256 + lo``, before the block's single float
  multiply-add: activations good to ``max|x_block| / (127 * 512)`` (about 16 bits; twice that
  where lo's clamp to +-127 bites). Summing in one integer took the split's cost over one
  int8 pass from ~1.5x to 1.25-1.35x at one row. Why the default: on the shipped SmolLM2 Q4_1,
  teacher-forced greedy tokens agreed with the float32 path 97.8% of the time with one int8
  pass (6,262 of 6,400 over 50 chat prompts: a 135M model has many near-ties, and one
  pass's rounding moved logits by ~1 on average) and 100% with the split, which cost 1.4x
  the int8 pass's time at one row and 1.9x at 256 rows (same run, loaded machine), for a
  single stream still ~1.8x llama.cpp's (docs/benchmarks.md, issue #28).
  Measured on the 2-core AMD EPYC (Zen 4, AVX-512 VNNI) development machine, SmolLM2-135M's
  shapes (N, K in 192-1536 x 576-1536), against float32 ``torch.matmul`` of the dequantized
  weight (``python -m bench.quant_linear``; a shared machine, so rough), the one-pass int8
  method: one row (decode), 1.5-2.6x faster at 576-1536 outputs and even at 192; 256 rows
  (prefill), 0.9-1.25x the matmul's time, with 4-7x less weight memory. ``DECODE_TO_FLOAT``
  took 2.6-3.2x the matmul's time at one row and 3.2-4.4x at 256.
  Per byte of weight, the other types decode about as fast as Q4_1 (one row, one thread,
  ``--types``, 576-1536 outputs, the super-block types at in_features 768 and 1536; a loaded
  machine, so rough): the int8 method read Q4_K at 13-16 GB/s, Q5_K at 15-18, Q6_K at 20-23,
  Q5_0 and Q5_1 at 12-16, against Q4_1's 12-15 and Q8_0's 24-32 in the same run.

A step of ``WIDEN_MIN_ROWS`` rows or more (batched decode, prefill) does not use these
methods: :func:`quantized_linear` widens the weight a cache-sized slice of rows at a time
(``tollway_quant_dequantize``, the DECODE_TO_FLOAT decode) and runs one float32 oneDNN matmul
per slice. The split kernel's time grows with every row (each row is its own dot products),
while the widening is paid once per step (``decode_block``, 20 G values/s on one thread here)
and oneDNN's matmul is ~10x the split kernel's rate per row; measured on SmolLM2's layer
shapes and its 49,152-row output projection (2 threads, one run): 1.0-1.3x the split kernel's
time at 8 rows, 0.77-0.88x at 10, 0.55-0.85x at 16, 0.36-0.52x at 48 and 0.23-0.37x at 256.
oneDNN took 0.4x ``torch.mm``'s time on the same slices (on AMD processors the latter does not
take its fastest path). The weight is still stored quantized; the float32 slice is transient.
(The native decoder still runs decode steps of up to 16 sequences with the split kernel: at
10-16 sequences its whole step beat the layer-by-layer widened path, by 1.46x at 10, and tied
at 16; ``python -m bench.decode_step_batches``.)

**Tiles** (:mod:`kernels.quant_tiles`, ``kernels/csrc/quant_tiles.h``): where the kernel is
built with AVX-512 VNNI, Q4_0, Q4_1 and Q8_0 weights whose rows are a multiple of 16 are
regrouped at load sixteen rows at a time (the same bytes), and the split method then takes
one activation word against sixteen rows per instruction, their scales one vector
conversion per block, no horizontal sums. Against the row kernel on SmolLM2's shapes (2
threads, ``python -m bench.quant_linear``): 1.9-2.6x faster at one row and 2.2-3.5x at 4-512
rows; against the widened oneDNN matmul 1.2-1.4x faster at 128-192 rows and 0.92-1.26x at
512, so tiled weights are never widened. One decoding sequence of the shipped SmolLM2 Q4_1
decodes 1.3-1.9x faster than with the row kernel (docs/benchmarks.md, issue #28's third
sitting).

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

from kernels import quant_tiles
from kernels.cpu_build import load_kernels

SOURCE = Path(__file__).parent / "csrc" / "quant_linear_cpu.c"
_ABI_VERSION = 5


class GGUFQuantType(IntEnum):
    """The supported block types, by ggml's type id (``gguf.GGMLQuantizationType``)."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


BLOCK_BYTES = {
    GGUFQuantType.Q4_0: 18,
    GGUFQuantType.Q4_1: 20,
    GGUFQuantType.Q5_0: 22,
    GGUFQuantType.Q5_1: 24,
    GGUFQuantType.Q8_0: 34,
    GGUFQuantType.Q4_K: 144,
    GGUFQuantType.Q5_K: 176,
    GGUFQuantType.Q6_K: 210,
}
SUPER_BLOCK_TYPES = frozenset({GGUFQuantType.Q4_K, GGUFQuantType.Q5_K, GGUFQuantType.Q6_K})
# values per block: the super-block ("K") types hold 256, so their in_features % 256 == 0
BLOCK_VALUES = {kind: 256 if kind in SUPER_BLOCK_TYPES else 32 for kind in GGUFQuantType}


class QuantLinearMethod(IntEnum):
    """How the kernel spends a block (values are the C kernel's)."""

    DECODE_TO_FLOAT = 0
    INT8_ACTIVATIONS = 1
    INT8_SPLIT_ACTIVATIONS = 2


DEFAULT_METHOD = QuantLinearMethod.INT8_SPLIT_ACTIVATIONS
# From this many rows (batched decode, prefill), a float32 oneDNN matmul on the weight
# widened a slice at a time beats the split int8 kernel, whose time grows with every row:
# 0.77-0.88x its time at 10 rows on SmolLM2's layer shapes and output projection, 0.2-0.4x at
# 256; at 8 rows 0.97-1.29x (module docstring).
WIDEN_MIN_ROWS = 10
WIDEN_SLICE_BYTES = 4 << 20  # float32 rows widened at a time: stay in L2/L3 for the matmul


@dataclass(frozen=True)
class GGUFBlockWeight:
    """A ``[out_features, in_features]`` weight as GGUF stores it: ``blocks`` is uint8
    ``[out_features, in_features // block values * block bytes]``, each row its blocks in k
    order. ``tiled``: the same bytes regrouped sixteen rows at a time (:mod:`kernels.quant_tiles`),
    ``blocks`` then ``[out_features / 16, ...]``; made by :meth:`tiled_for_kernel`, undone by
    :meth:`in_file_layout`."""

    blocks: torch.Tensor
    quant_type: GGUFQuantType
    out_features: int
    in_features: int
    tiled: bool = False

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, quant_type: int) -> GGUFBlockWeight:
        """``blocks`` checked for the kernel: raises ``ValueError`` naming what is wrong."""
        try:
            kind = GGUFQuantType(quant_type)
        except ValueError:
            names = ", ".join(kind.name for kind in GGUFQuantType)
            raise ValueError(f"ggml type {quant_type} is not one of {names}") from None
        if blocks.dtype != torch.uint8 or blocks.dim() != 2:
            raise ValueError(
                f"blocks must be a 2-D uint8 tensor, got {blocks.dtype} {blocks.dim()}-D"
            )
        out_features, row_bytes = blocks.shape
        block_bytes, block_values = BLOCK_BYTES[kind], BLOCK_VALUES[kind]
        if out_features < 1 or row_bytes < 1 or row_bytes % block_bytes != 0:
            raise ValueError(
                f"a {kind.name} row is whole blocks of {block_bytes} bytes ({block_values} "
                f"values each, so in_features must be a multiple of {block_values}), "
                f"got {row_bytes} bytes"
            )
        in_features = row_bytes // block_bytes * block_values
        return cls(blocks.contiguous(), kind, out_features, in_features)

    @property
    def kernel_type(self) -> int:
        """The native kernel's type id: ggml's, flagged when tiled."""
        return int(self.quant_type) | (quant_tiles.TILED_TYPE_FLAG if self.tiled else 0)

    def tiled_for_kernel(self) -> GGUFBlockWeight:
        """This weight in tiles when the native kernel here reads them (AVX-512 VNNI) and the
        type and row count allow (Q4_0, Q4_1, Q8_0; rows a multiple of 16); else itself."""
        if self.tiled or not self.can_tile():
            return self
        tiles = quant_tiles.tile(self.blocks, int(self.quant_type))
        return GGUFBlockWeight(tiles, self.quant_type, self.out_features, self.in_features, True)

    def can_tile(self) -> bool:
        return quant_tiles.is_tileable(int(self.quant_type), self.out_features) and (
            tiles_available()
        )

    def in_file_layout(self) -> GGUFBlockWeight:
        """This weight with ``blocks`` in the file's layout (itself unless tiled)."""
        if not self.tiled:
            return self
        blocks = quant_tiles.untile(self.blocks, int(self.quant_type))
        return GGUFBlockWeight(blocks, self.quant_type, self.out_features, self.in_features)

    def row_blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64) in the file's layout: an embedding's tokens."""
        if not self.tiled:
            return self.blocks.index_select(0, rows)
        return quant_tiles.rows_of(self.blocks, int(self.quant_type), rows)

    def row_range(self, first: int, end: int) -> GGUFBlockWeight:
        """Rows ``[first, end)`` as a weight in the file's layout."""
        if not self.tiled:
            return GGUFBlockWeight.from_blocks(self.blocks[first:end], self.quant_type)
        tile_rows = quant_tiles.TILE_ROWS
        first_tile, end_tile = first // tile_rows, -(-end // tile_rows)
        rows = quant_tiles.untile(self.blocks[first_tile:end_tile], int(self.quant_type))
        offset = first_tile * tile_rows
        return GGUFBlockWeight.from_blocks(rows[first - offset : end - offset], self.quant_type)


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
            "tollway_quant_linear_tiles": ([], ctypes.c_int),
            "tollway_quant_dequantize": (
                [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
                + [ctypes.c_int64] * 2
                + [ctypes.c_int],
                ctypes.c_int,
            ),
            "tollway_quant_gather_rows": (
                [ctypes.c_void_p, ctypes.c_int]
                + [ctypes.c_int64] * 2
                + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p],
                ctypes.c_int,
            ),
        },
    )


def is_available() -> bool:
    return native_library() is not None


def tiles_available() -> bool:
    """Whether the native kernel here reads tiled weights (built with AVX-512 VNNI)."""
    library = native_library()
    return library is not None and bool(library.tollway_quant_linear_tiles())


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
    method: QuantLinearMethod | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:  # [num_rows, out_features] float32
    """``x @ W.T`` over the stored blocks: the native kernel, else dequantize + matmul.
    ``method`` ``None`` picks by the number of rows: from ``WIDEN_MIN_ROWS`` rows an untiled
    weight is widened a cache-sized slice of rows at a time for a float32 matmul
    (`_widened_matmul`), below it ``DEFAULT_METHOD``; a tiled weight always runs the split
    method (its kernel beats the widened matmul up to 512 rows and more, module docstring).
    ``num_threads`` defaults to PyTorch's; the kernel's result does not depend on it."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [rows, {weight.in_features}], got {list(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    library = native_library()
    if library is None:
        return x @ dequantize(weight).T
    num_rows = x.shape[0]
    if method is None:
        if num_rows >= WIDEN_MIN_ROWS and not weight.tiled:
            return _widened_matmul(x, weight, num_threads)
        method = DEFAULT_METHOD
    if weight.tiled and method != QuantLinearMethod.INT8_SPLIT_ACTIVATIONS:
        weight = weight.in_file_layout()  # tiles run the split method only
    y = torch.empty((num_rows, weight.out_features), dtype=torch.float32)
    if num_rows == 0:
        return y
    x = x.contiguous()
    status = library.tollway_quant_linear(
        weight.blocks.data_ptr(),
        weight.kernel_type,
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


def widened(
    weight: GGUFBlockWeight,
    first_row: int = 0,
    end_row: int | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:  # [end_row - first_row, in_features] float32
    """Rows ``[first_row, end_row)`` of the weight as float32, decoded by the native kernel's
    threads (``dequantize`` where there is none): a transient copy for a step of many rows."""
    end_row = weight.out_features if end_row is None else end_row
    if not 0 <= first_row < end_row <= weight.out_features:
        raise ValueError(f"rows [{first_row}, {end_row}) are not rows of the weight")
    rows = weight.row_range(first_row, end_row).blocks
    library = native_library()
    if library is None:
        return dequantize(GGUFBlockWeight.from_blocks(rows, weight.quant_type))
    out = torch.empty((end_row - first_row, weight.in_features), dtype=torch.float32)
    status = library.tollway_quant_dequantize(
        rows.data_ptr(),
        int(weight.quant_type),
        out.data_ptr(),
        end_row - first_row,
        weight.in_features,
        num_threads or torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"the kernel could not widen a {weight.quant_type.name} weight")
    return out


def gathered_rows(weight: GGUFBlockWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[n]``) of the weight as float32 ``[n, in_features]``, read from
    the blocks as held (tiled or not) with :func:`dequantize`'s values: an embedding's tokens,
    one native call (the tensor ops it replaces took ~0.15 ms a decode step)."""
    rows = rows.reshape(-1).to(torch.int64).contiguous()
    library = native_library()
    if library is None:
        return dequantize(GGUFBlockWeight.from_blocks(weight.row_blocks(rows), weight.quant_type))
    out = torch.empty((rows.shape[0], weight.in_features), dtype=torch.float32)
    if rows.shape[0] == 0:
        return out
    status = library.tollway_quant_gather_rows(
        weight.blocks.data_ptr(),
        weight.kernel_type,
        weight.out_features,
        weight.in_features,
        rows.data_ptr(),
        rows.shape[0],
        out.data_ptr(),
    )
    if status != 0:
        raise IndexError(f"a row is outside the weight's {weight.out_features} rows")
    return out


def _widened_matmul(
    x: torch.Tensor, weight: GGUFBlockWeight, num_threads: int | None
) -> torch.Tensor:
    """``x @ W.T`` for many rows: W widened ``WIDEN_SLICE_BYTES`` of float32 rows at a time
    (they stay in cache for the matmul) and each slice's outputs from one float32 matmul,
    oneDNN's where PyTorch has it (2.2-2.7x ``torch.mm``'s speed on these shapes here)."""
    slice_rows = max(1, WIDEN_SLICE_BYTES // (4 * weight.in_features))
    x = x.contiguous()
    if slice_rows >= weight.out_features:
        return _float_matmul(x, widened(weight, num_threads=num_threads))
    y = torch.empty((x.shape[0], weight.out_features), dtype=torch.float32)
    for first in range(0, weight.out_features, slice_rows):
        end = min(first + slice_rows, weight.out_features)
        y[:, first:end] = _float_matmul(x, widened(weight, first, end, num_threads))
    return y


def _float_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # x @ weight.T
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return x @ weight.T


def dequantize(weight: GGUFBlockWeight) -> torch.Tensor:  # [out_features, in_features]
    """The weight as float32 (the fallback's path; ``gguf``'s dequantize is the referee, and
    each type below follows its arithmetic order, so the results are equal)."""
    kind = weight.quant_type
    num_blocks = weight.out_features * weight.in_features // BLOCK_VALUES[kind]
    raw = weight.in_file_layout().blocks.reshape(num_blocks, BLOCK_BYTES[kind])
    values = _DEQUANTIZERS[kind](raw)  # [num_blocks, block values]
    return values.reshape(weight.out_features, weight.in_features)


def _fp16(raw: torch.Tensor, offset: int) -> torch.Tensor:  # [num_blocks, 1] float32
    return raw[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _shifted(packed: torch.Tensor, shifts: tuple[int, ...], width: int) -> torch.Tensor:
    """``packed`` [num_blocks, chunks * width] as [num_blocks, chunks * len(shifts), width]:
    each chunk of ``width`` bytes shifted right by each of ``shifts`` in turn."""
    by = torch.tensor(shifts, dtype=torch.uint8).reshape(1, 1, -1, 1)
    chunks = packed.reshape(packed.shape[0], -1, 1, width) >> by
    return chunks.reshape(packed.shape[0], -1, width)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    return raw[:, 2:].contiguous().view(torch.int8).float() * _fp16(raw, 0)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # [num_blocks, 16] -> [num_blocks, 32]
    return torch.cat((packed & 15, packed >> 4), dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:  # [num_blocks, 4] -> [num_blocks, 32]
    """Bit i of the little-endian 32 bits, times 16 (Q5_0's and Q5_1's high bit)."""
    return (_shifted(qh, tuple(range(8)), 1) & 1).reshape(qh.shape[0], 32) << 4


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    return (_nibbles(raw[:, 2:]).float() - 8) * _fp16(raw, 0)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    return _fp16(raw, 0) * _nibbles(raw[:, 4:]).float() + _fp16(raw, 2)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(raw[:, 6:]) | _fifth_bits(raw[:, 2:6])).float() - 16
    return _fp16(raw, 0) * q


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(raw[:, 8:]) | _fifth_bits(raw[:, 4:8])).float()
    return _fp16(raw, 0) * q + _fp16(raw, 2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight 6-bit sub-block scales and mins from their 12 bytes."""
    low_scales, low_mins, rest = packed.reshape(-1, 3, 4).unbind(dim=1)  # [num_blocks, 4] each
    scales = torch.cat((low_scales & 63, (rest & 15) | ((low_scales >> 2) & 48)), dim=1)
    mins = torch.cat((low_mins & 63, (rest >> 4) | ((low_mins >> 2) & 48)), dim=1)
    return scales.float().unsqueeze(2), mins.float().unsqueeze(2)  # [num_blocks, 8, 1] each


def _q45_k(raw: torch.Tensor) -> torch.Tensor:
    """Q4_K, or Q5_K (176-byte blocks, with qh before qs)."""
    is_q5 = raw.shape[1] == BLOCK_BYTES[GGUFQuantType.Q5_K]
    scales, mins = _k_scales_mins(raw[:, 4:16])
    q = _shifted(raw[:, 48:] if is_q5 else raw[:, 16:], (0, 4), 32) & 15  # [num_blocks, 8, 32]
    if is_q5:
        q = q | ((_shifted(raw[:, 16:48], tuple(range(8)), 32) & 1) << 4)
    values = (_fp16(raw, 0).unsqueeze(2) * scales) * q.float()
    return (values - _fp16(raw, 2).unsqueeze(2) * mins).reshape(raw.shape[0], -1)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    low = _shifted(raw[:, :128], (0, 4), 64).reshape(raw.shape[0], -1, 32) & 15
    high = _shifted(raw[:, 128:192], (0, 2, 4, 6), 32) & 3  # [num_blocks, 8, 32]
    q = ((low | (high << 4)).view(torch.int8) - 32).float().reshape(raw.shape[0], 16, 16)
    scales = raw[:, 192:208].contiguous().view(torch.int8).float().unsqueeze(2)
    return ((_fp16(raw, 208).unsqueeze(2) * scales) * q).reshape(raw.shape[0], -1)


_DEQUANTIZERS = {
    GGUFQuantType.Q4_0: _q4_0,
    GGUFQuantType.Q4_1: _q4_1,
    GGUFQuantType.Q5_0: _q5_0,
    GGUFQuantType.Q5_1: _q5_1,
    GGUFQuantType.Q8_0: _q8_0,
    GGUFQuantType.Q4_K: _q45_k,
    GGUFQuantType.Q5_K: _q45_k,
    GGUFQuantType.Q6_K: _q6_k,
}
