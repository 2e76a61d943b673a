"""The Triton quantized linears against dequantize-then-matmul (interpreted on CPU).

Tolerances: the kernel multiplies x by the exact integer codes, accumulates in float32 and
scales the float32 sums, so it differs from the reference only by summation order (float32:
~1e-6 relative to the terms) and, for float16/bfloat16, by where the single final rounding
lands: at most one unit in the last place (2^-10 and 2^-7 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.quantized_weights import (
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
    reference_linear,
)
from kernels.triton_quant_linear import quantized_linear

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {  # (rtol, atol)
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


@dataclass(frozen=True)
class Format:
    name: str
    out_features: int
    in_features: int
    group_size: int | None  # None: int8 per output channel

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
        """On DEVICE, the scales in ``scale_dtype``."""
        if self.group_size is None:
            int8 = quantize_int8(weight)
            return Int8Weight(int8.qweight.to(DEVICE), int8.scales.to(DEVICE, scale_dtype))
        int4 = quantize_int4(weight, self.group_size)
        scales, mins = int4.scales.to(DEVICE, scale_dtype), int4.mins.to(DEVICE, scale_dtype)
        return Int4Weight(int4.packed.to(DEVICE), scales, mins, self.group_size)


# N and K off the tile sizes (decode 32, prefill 64 output features; int8 takes K 64 at a time).
FORMATS = [
    Format("int8", 37, 100, None),
    Format("int4-g32", 37, 96, 32),
    Format("int4-g64", 45, 128, 64),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_weight(
    fmt: Format, seed: int, scale_dtype: torch.dtype = torch.float32
) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(fmt.out_features, fmt.in_features, generator=gen)
    return fmt.quantize(weight, scale_dtype)


def assert_matches_reference(x: torch.Tensor, weight: QuantizedWeight) -> None:
    out = quantized_linear(x, weight)
    assert out.dtype == x.dtype
    assert out.shape == (x.shape[0], weight.out_features)
    rtol, atol = TOLERANCES[x.dtype]
    torch.testing.assert_close(
        out.float(), reference_linear(x, weight).float(), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_matches_reference(num_rows: int, fmt: Format, dtype: torch.dtype) -> None:
    weight = make_weight(fmt, seed=num_rows)
    gen = torch.Generator().manual_seed(100 + num_rows)
    x = torch.randn(num_rows, fmt.in_features, generator=gen).to(dtype).to(DEVICE)
    assert_matches_reference(x, weight)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_strided_activations_and_half_precision_scales(fmt: Format) -> None:
    weight = make_weight(fmt, seed=7, scale_dtype=torch.float16)
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(5, fmt.in_features + 3, generator=gen).to(torch.float16).to(DEVICE)
    x = wide[:, 3:]  # [5, in_features] with a row stride of in_features + 3
    assert_matches_reference(x, weight)


def test_no_rows() -> None:
    weight = make_weight(FORMATS[1], seed=9)
    out = quantized_linear(torch.zeros(0, 96, device=DEVICE), weight)
    assert out.shape == (0, 37)


def test_bad_activations_are_rejected() -> None:
    weight = make_weight(FORMATS[0], seed=10)
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        quantized_linear(torch.zeros(2, 100, dtype=torch.int8, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"x must be \[num_rows, 100\]"):
        quantized_linear(torch.zeros(2, 96, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"x must be \[num_rows, 100\]"):
        quantized_linear(torch.zeros(100, device=DEVICE), weight)
