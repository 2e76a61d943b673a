"""Weight-only quantized linear formats (int8, int4) and their plain-PyTorch reference.

This module owns the formats: how a float ``[out_features, in_features]`` weight becomes
integers and scales, how int4 codes are packed, and ``reference_linear`` (dequantize, then
one float32 matmul), the ground truth :mod:`kernels.triton_quant_linear` is tested against.

int8, per output channel (symmetric)::

    qweight [N, K] int8 in [-127, 127]     scales [N] float
    W[n, k] = qweight[n, k] * scales[n]    scales[n] = max_k |W[n, k]| / 127

int4, in groups of ``group_size`` (32 or 64) along K, asymmetric (GGUF's Q4_1 form, so
``tollway convert`` can write it without requantizing)::

    codes  [N, K] in 0..15                 scales, mins [N, K // group_size] float
    W[n, k] = codes[n, k] * scales[n, g] + mins[n, g]        g = k // group_size

Why asymmetric: a group's values are rarely symmetric about 0, and a symmetric grid (Q4_0's
``(code - 8) * scale``) spends codes on the side the group does not reach; a minimum per group
puts all 16 codes over the group's actual range. The cost is one more float per group (a
float16 on the load path, which Q4_1 stores anyway). The scale and minimum are searched per
group (:mod:`kernels.int4_quantization`), never worse than plain min/max rounding.

Two codes share a byte, row by row along K (unlike Q4_1, which pairs k with k + 16): byte
``i`` of row ``n`` holds column ``2i`` in its LOW half-byte and column ``2i + 1`` in its
HIGH half-byte::

    packed [N, K // 2] uint8    packed[n, i] = codes[n, 2i] | codes[n, 2i + 1] << 4

The codes 0..15 are exact in float16 and bfloat16, which lets the kernel multiply them
unscaled, apply each group's scale to the float32 partial sums and add the minimum times
the sum of x over the group. Scales and mins may be float16, bfloat16 or float32 (the
quantize helpers return float32 unless given another ``scale_dtype``, and choose the codes
against the scale and minimum as stored); every reader widens them to float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int4_quantization import INT4_MAX_CODE, searched_codes

INT4_GROUP_SIZES = (32, 64)
INT8_MAX = 127
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Int8Weight:
    """An int8 weight with one scale per output channel (see the module docstring)."""

    qweight: torch.Tensor  # [out_features, in_features] int8
    scales: torch.Tensor  # [out_features] float

    def __post_init__(self) -> None:
        if self.qweight.dtype != torch.int8 or self.qweight.dim() != 2:
            raise ValueError(
                "an int8 weight must be a 2-D int8 [out_features, in_features] tensor, got "
                f"{self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        _check_scales(self.scales, (int(self.qweight.shape[0]),))

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])


@dataclass(frozen=True)
class Int4Weight:
    """Packed int4 codes with one scale and one minimum per group of ``group_size`` inputs
    (module docstring)."""

    packed: torch.Tensor  # [out_features, in_features // 2] uint8
    scales: torch.Tensor  # [out_features, in_features // group_size] float
    mins: torch.Tensor  # [out_features, in_features // group_size] float
    group_size: int

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise ValueError(
                "an int4 weight must be a 2-D uint8 [out_features, in_features // 2] tensor "
                f"(two codes a byte), got {self.packed.dtype} {tuple(self.packed.shape)}"
            )
        check_in_features(self.in_features, self.group_size)
        group_shape = (self.out_features, self.in_features // self.group_size)
        _check_scales(self.scales, group_shape)
        _check_scales(self.mins, group_shape, "mins")
        if self.mins.device != self.scales.device:
            raise ValueError(f"mins are on {self.mins.device}, scales on {self.scales.device}")

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    @property
    def in_features(self) -> int:
        return 2 * int(self.packed.shape[1])


QuantizedWeight = Int8Weight | Int4Weight


def check_group_size(group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")


def check_in_features(in_features: int, group_size: int) -> None:
    if in_features <= 0 or in_features % group_size:
        raise ValueError(
            f"int4 needs in_features (K) to be a positive multiple of the group size "
            f"{group_size}, got {in_features}"
        )


def check_activations(x: torch.Tensor, weight: QuantizedWeight) -> None:
    """``x`` must be ``[M, in_features]`` in a float dtype on the weight's device."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2 or int(x.shape[1]) != weight.in_features:
        raise ValueError(
            f"x must be [num_rows, {weight.in_features}] for this weight, got {tuple(x.shape)}"
        )
    if x.device != weight.scales.device:
        raise ValueError(f"x is on {x.device}, the weight on {weight.scales.device}")


def quantize_int8(
    weight: torch.Tensor,  # [N, K] float
    scale_dtype: torch.dtype = torch.float32,
) -> Int8Weight:
    """Round each output channel to int8 with a scale of its largest magnitude over 127.
    The scale is rounded to ``scale_dtype`` first and the codes are chosen against the
    rounded scale, so ``codes * scale`` stays within half a step of the weight."""
    _check_float_weight(weight)
    w = weight.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).to(scale_dtype)  # [N]
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    qweight = torch.round(w / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(qweight, scales)


def int4_codes(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked int4 codes ``[N, K]`` uint8 with each group's scale and minimum
    ``[N, K // G]`` in ``scale_dtype``, searched for the smallest squared error
    (:mod:`kernels.int4_quantization`); the codes are chosen against the rounded pair."""
    _check_float_weight(weight)
    check_group_size(group_size)
    check_in_features(int(weight.shape[1]), group_size)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float16, bfloat16 or float32, got {scale_dtype}")
    return searched_codes(weight, group_size, scale_dtype)


def quantize_int4(
    weight: torch.Tensor,  # [N, K] float
    group_size: int,
    scale_dtype: torch.dtype = torch.float32,
) -> Int4Weight:
    codes, scales, mins = int4_codes(weight, group_size, scale_dtype)
    return Int4Weight(pack_int4(codes), scales, mins, group_size)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:  # [N, K] uint8 0..15 -> [N, K // 2] uint8
    """Column ``2i`` into the low half-byte of byte ``i``, column ``2i + 1`` into the high."""
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(
            f"int4 codes must be a 2-D uint8 tensor with an even number of columns, got "
            f"{codes.dtype} {tuple(codes.shape)}"
        )
    if bool((codes > INT4_MAX_CODE).any()):
        raise ValueError("int4 codes must lie in 0..15")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # [N, K // 2] uint8 -> [N, K] uint8
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=2).reshape(packed.shape[0], -1)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:  # [out_features, in_features] f32
    if isinstance(weight, Int8Weight):
        return weight.qweight.float() * weight.scales.float()[:, None]
    codes = unpack_int4(weight.packed).float()  # [N, K]
    scales = weight.scales.float().repeat_interleave(weight.group_size, dim=1)  # [N, K]
    mins = weight.mins.float().repeat_interleave(weight.group_size, dim=1)  # [N, K]
    return codes * scales + mins


def reference_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: QuantizedWeight,
) -> torch.Tensor:  # [num_rows, out_features], x's dtype
    """``x @ dequantize(weight).T`` in float32, rounded once to x's dtype."""
    check_activations(x, weight)
    return (x.float() @ dequantize(weight).T).to(x.dtype)


def _check_float_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            "the weight to quantize must be a 2-D float [out_features, in_features] tensor, "
            f"got {weight.dtype} {tuple(weight.shape)}"
        )


def _check_scales(scales: torch.Tensor, shape: tuple[int, ...], what: str = "scales") -> None:
    if scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"{what} must be float16, bfloat16 or float32, got {scales.dtype}")
    if tuple(scales.shape) != shape:
        raise ValueError(f"{what} must be {list(shape)}, got {list(scales.shape)}")
