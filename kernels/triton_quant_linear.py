# mypy: disable-error-code="no-untyped-def"
"""Triton weight-only quantized linears: ``y = x @ dequantize(W).T`` with W kept int8 or int4.

The formats are :mod:`kernels.quantized_weights`' (int8 per output channel; int4 in groups
of 32 or 64 along K with a scale and a minimum each, two codes a byte, column ``2i`` in the
low half-byte). The weight is read as stored and widened tile by tile inside the kernel;
nothing dequantized reaches memory.

The integer values (int8 codes, int4 codes 0..15) are exact in float16 and bfloat16, so
the kernel multiplies x by them unscaled on the tensor cores, accumulates in float32 and
applies the scales to the float32 sums: once per output channel at the end for int8, once
per group for int4 (the K tile *is* the group). An int4 group's minimum multiplies the sum
of x over the group's columns, the same for every output feature: an outer product of the
x row sums and the group's mins::

    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    int8:  acc = sum_k x[:, k] * q[n, k]             y = acc * scales[n]
    int4:  acc += scales[n, g] * sum_{k in g} x[:, k] * code[n, k]
                + mins[n, g] * sum_{k in g} x[:, k]

Integers reach x's dtype through float32 (exact either way; Triton's interpreter turns int8
straight into bfloat16 wrongly).

So the result differs from :func:`kernels.quantized_weights.reference_linear` only by the
summation order and the final rounding to x's dtype. float32 x uses exact fp32 products
(``input_precision="ieee"``, as the attention kernels do).

One launch path serves decode and prefill; only the tile sizes change (:func:`_launch_config`,
untuned: ``bench/kernels_gpu.py`` measures them). ``tl.dot`` needs every tile dimension to be
at least 16, so a decode step of one row pads its row tile to 16; it is memory bound either
way, and narrow 32-wide output tiles give a 4096-feature layer 128 programs to spread over
the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quantized_weights import (
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    check_activations,
)
from kernels.triton_launch import dot_precision

DECODE_MAX_ROWS = 16  # up to this many rows use the decode tiles
INT8_BLOCK_K = 64


@triton.jit
def _int8_linear_kernel(
    x_ptr,  # [M, K] float
    qweight_ptr,  # [N, K] int8
    scales_ptr,  # [N] float
    out_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_x_row,
    stride_x_col,
    stride_w_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    is_row = rows < M
    is_col = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row  # [BLOCK_M, 1]
    w_cols = qweight_ptr + cols.to(tl.int64)[None, :] * stride_w_row  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        is_k = ks < K
        x = tl.load(
            x_rows + ks[None, :] * stride_x_col, mask=is_row[:, None] & is_k[None, :], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        q = tl.load(
            w_cols + ks[:, None], mask=is_k[:, None] & is_col[None, :], other=0
        )  # [BLOCK_K, BLOCK_N] int8
        acc = tl.dot(x, q.to(tl.float32).to(x.dtype), acc, input_precision=DOT_PRECISION)
    scales = tl.load(scales_ptr + cols, mask=is_col, other=0.0).to(tl.float32)
    out = acc * scales[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=is_row[:, None] & is_col[None, :],
    )


@triton.jit
def _int4_linear_kernel(
    x_ptr,  # [M, K] float
    packed_ptr,  # [N, K // 2] uint8, column 2i low half-byte, 2i + 1 high
    scales_ptr,  # [N, K // GROUP] float
    mins_ptr,  # [N, K // GROUP] float
    out_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_x_row,
    stride_x_col,
    stride_packed_row,
    stride_scales_row,
    stride_mins_row,
    stride_out_row,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    is_row = rows < M
    is_col = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row  # [BLOCK_M, 1]
    w_cols = packed_ptr + cols.to(tl.int64)[None, :] * stride_packed_row  # [1, BLOCK_N]
    s_cols = scales_ptr + cols.to(tl.int64) * stride_scales_row  # [BLOCK_N]
    m_cols = mins_ptr + cols.to(tl.int64) * stride_mins_row  # [BLOCK_N]
    byte_offsets = tl.arange(0, GROUP // 2)
    k_offsets = tl.arange(0, GROUP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for group in range(0, K // GROUP):
        packed = tl.load(
            w_cols + (group * (GROUP // 2) + byte_offsets)[:, None],
            mask=is_col[None, :],
            other=0,
        )  # [GROUP // 2, BLOCK_N] uint8
        low = packed & 0xF  # columns 2i
        high = packed >> 4  # columns 2i + 1
        # [GROUP // 2, BLOCK_N, 2] -> [BLOCK_N, GROUP // 2, 2] -> [BLOCK_N, GROUP]: 2i, 2i + 1
        codes = tl.reshape(tl.permute(tl.join(low, high), (1, 0, 2)), (BLOCK_N, GROUP))
        x = tl.load(
            x_rows + (group * GROUP + k_offsets)[None, :] * stride_x_col,
            mask=is_row[:, None],
            other=0.0,
        )  # [BLOCK_M, GROUP]
        weights = tl.trans(codes.to(tl.float32).to(x.dtype))  # [GROUP, BLOCK_N]
        partial = tl.dot(x, weights, input_precision=DOT_PRECISION)
        scales = tl.load(s_cols + group, mask=is_col, other=0.0).to(tl.float32)
        mins = tl.load(m_cols + group, mask=is_col, other=0.0).to(tl.float32)
        x_sums = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
        acc += partial * scales[None, :] + x_sums[:, None] * mins[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=is_row[:, None] & is_col[None, :],
    )


def _launch_config(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a 16-row tile for decode (``tl.dot``'s minimum) with
    narrow output tiles for more programs; 64 x 64 tiles for prefill."""
    if num_rows <= DECODE_MAX_ROWS:
        return 16, 32, 4
    return 64, 64, 4


def quantized_linear(
    x: torch.Tensor,  # [num_rows, in_features] float16, bfloat16 or float32
    weight: QuantizedWeight,
) -> torch.Tensor:  # [num_rows, out_features], x's dtype
    """``x @ dequantize(weight).T``, accumulated in float32, for an int8 or int4 weight."""
    check_activations(x, weight)
    num_rows = int(x.shape[0])
    out = torch.empty((num_rows, weight.out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or weight.out_features == 0:
        return out
    block_m, block_n, num_warps = _launch_config(num_rows)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(weight.out_features, block_n))
    if isinstance(weight, Int8Weight):
        qweight = weight.qweight if weight.qweight.stride(1) == 1 else weight.qweight.contiguous()
        _int8_linear_kernel[grid](
            x,
            qweight,
            weight.scales.contiguous(),
            out,
            num_rows,
            weight.out_features,
            weight.in_features,
            x.stride(0),
            x.stride(1),
            qweight.stride(0),
            out.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=INT8_BLOCK_K,
            DOT_PRECISION=dot_precision(x.dtype),
            num_warps=num_warps,
        )
        return out
    packed = weight.packed if weight.packed.stride(1) == 1 else weight.packed.contiguous()
    scales = weight.scales if weight.scales.stride(1) == 1 else weight.scales.contiguous()
    mins = weight.mins if weight.mins.stride(1) == 1 else weight.mins.contiguous()
    _int4_linear_kernel[grid](
        x,
        packed,
        scales,
        mins,
        out,
        num_rows,
        weight.out_features,
        weight.in_features,
        x.stride(0),
        x.stride(1),
        packed.stride(0),
        scales.stride(0),
        mins.stride(0),
        out.stride(0),
        GROUP=weight.group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=num_warps,
    )
    return out


__all__ = ["Int4Weight", "Int8Weight", "quantized_linear"]
