"""The int8/int4 weight formats: quantization error bounds, the int4 search against min/max
rounding, the int4 packing, bad inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.int4_quantization import CHUNK_VALUES
from kernels.quantized_weights import (
    Int4Weight,
    Int8Weight,
    dequantize,
    int4_codes,
    pack_int4,
    quantize_int4,
    quantize_int8,
    reference_linear,
    unpack_int4,
)


def random_weight(num_rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, in_features, generator=gen)


def test_even_columns_go_to_the_low_half_byte() -> None:
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    assert pack_int4(codes).tolist() == [[0x21, 0x43], [0x0F, 0xF0]]


def test_unpack_inverts_pack() -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


def min_max_error(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Per group, the squared error of plain min/max rounding (GGUF's Q4_1 quantizer):
    ``scale = (max - min) / 15``, ``min = min``, both rounded, then the nearest codes."""
    groups = weight.float().reshape(-1, group_size)  # [num_groups, G]
    low = groups.amin(dim=1, keepdim=True)
    scale = ((groups.amax(dim=1, keepdim=True) - low) / 15).to(scale_dtype).float()
    minimum = low.to(scale_dtype).float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((groups - minimum) / safe).clamp(0, 15) * (scale != 0)
    return (codes * scale + minimum - groups).pow(2).sum(dim=1)


def group_error(quantized: Int4Weight, weight: torch.Tensor) -> torch.Tensor:
    return (dequantize(quantized) - weight).pow(2).reshape(-1, quantized.group_size).sum(dim=1)


def skewed_weight(num_rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Groups far from symmetric about 0: log-normal values, some rows shifted, outliers."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, in_features, generator=gen).exp()
    weight[::2] -= 0.5
    outliers = torch.rand(num_rows, in_features, generator=gen) < 0.02
    return torch.where(outliers, -4 * weight, weight) * 0.05


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_is_exact(group_size: int) -> None:
    weight = random_weight(7, 192)
    codes, scales, mins = int4_codes(weight, group_size)
    expected = codes.float() * scales.repeat_interleave(group_size, dim=1)
    expected += mins.repeat_interleave(group_size, dim=1)
    packed = quantize_int4(weight, group_size)
    assert torch.equal(unpack_int4(packed.packed), codes)
    assert torch.equal(packed.scales, scales)
    assert torch.equal(packed.mins, mins)
    assert torch.equal(dequantize(packed), expected)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("make_weight", [random_weight, skewed_weight], ids=lambda f: f.__name__)
def test_int4_search_is_never_worse_than_min_max_rounding(
    make_weight: Callable[[int, int, int], torch.Tensor], group_size: int, scale_dtype: torch.dtype
) -> None:
    weight = make_weight(24, 256, 11)
    quantized = quantize_int4(weight, group_size, scale_dtype)
    assert quantized.scales.dtype == quantized.mins.dtype == scale_dtype
    searched = group_error(quantized, weight)
    plain = min_max_error(weight, group_size, scale_dtype)
    assert bool((searched <= plain * (1 + 1e-6) + 1e-12).all())
    assert float(searched.sum()) < 0.9 * float(plain.sum())  # and the search does find better


def test_int4_codes_are_the_nearest_points_of_each_grid() -> None:
    weight = skewed_weight(6, 128, seed=3)
    quantized = quantize_int4(weight, 32, torch.float16)
    codes = unpack_int4(quantized.packed).float()
    step = quantized.scales.float().repeat_interleave(32, dim=1)
    low = quantized.mins.float().repeat_interleave(32, dim=1)
    error = (dequantize(quantized) - weight).abs()
    # inside the grid: half a step; beyond either end: the end code
    inside = (weight >= low) & (weight <= low + 15 * step)
    assert bool((error[inside] <= step[inside] / 2 * (1 + 1e-5) + 1e-7).all())
    assert bool((codes[weight < low] == 0).all())
    assert bool((codes[weight > low + 15 * step] == 15).all())


def test_int4_exactly_representable_grids_come_back_exactly() -> None:
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    codes[:, 0::32] = 0  # every group reaches both ends of its grid
    codes[:, 1::32] = 15
    scales = (torch.rand(8, 2, generator=gen) * 0.1 + 0.01).half().float()
    mins = (torch.randn(8, 2, generator=gen) * 0.2).half().float()
    weight = codes.float() * scales.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)
    quantized = quantize_int4(weight, 32, torch.float16)
    assert torch.equal(dequantize(quantized), weight)
    assert torch.equal(unpack_int4(quantized.packed), codes)


def test_int4_rows_are_fitted_alone_whatever_the_chunking() -> None:
    """A matrix of several chunks gives each row what it gives that row alone, every time."""
    weight = skewed_weight(3 * CHUNK_VALUES // 256 + 5, 256, seed=6)
    whole = int4_codes(weight, 64, torch.float16)
    again = int4_codes(weight, 64, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))
    for row in (0, CHUNK_VALUES // 256, weight.shape[0] - 1):
        alone = int4_codes(weight[row : row + 1], 64, torch.float16)
        assert all(torch.equal(a[row : row + 1], b) for a, b in zip(whole, alone, strict=True))


def test_int8_round_trip_and_error() -> None:
    weight = random_weight(6, 100, seed=3)
    quantized = quantize_int8(weight)
    assert quantized.qweight.dtype == torch.int8
    assert int(quantized.qweight.abs().max()) == 127
    expected = quantized.qweight.float() * quantized.scales[:, None]
    assert torch.equal(dequantize(quantized), expected)
    error = (dequantize(quantized) - weight).abs()
    assert bool((error <= quantized.scales[:, None] / 2 + 1e-6).all())


def test_zero_rows_quantize_to_zero() -> None:
    weight = torch.zeros(2, 64)
    assert torch.equal(dequantize(quantize_int8(weight)), weight)
    assert torch.equal(dequantize(quantize_int4(weight, 32)), weight)
    constant = torch.full((2, 64), 0.1)  # a group of one value: scale 0, min the value
    assert torch.equal(dequantize(quantize_int4(constant, 32)), constant)


def test_reference_linear_is_within_the_quantization_error() -> None:
    """|x @ (W' - W).T| <= |x| @ (largest error per weight).T: half a step for int8; for
    int4 each weight's own error (a clamped value may lie beyond half a step)."""
    weight = random_weight(5, 64, seed=4)
    x = random_weight(3, 64, seed=5)
    exact = x @ weight.T
    int8, int4 = quantize_int8(weight), quantize_int4(weight, 32)
    int8_bound = x.abs() @ (int8.scales[:, None] / 2).expand(5, 64).T
    int4_bound = x.abs() @ (dequantize(int4) - weight).abs().T
    for quantized, bound in ((int8, int8_bound), (int4, int4_bound)):
        error = (reference_linear(x, quantized) - exact).abs()
        assert bool((error <= bound + 1e-5).all())
        assert float(error.max()) > 0  # the formats do round


@pytest.mark.parametrize("in_features", [48, 100])
def test_int4_needs_whole_groups(in_features: int) -> None:
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        quantize_int4(random_weight(4, in_features), 32)
    packed = torch.zeros(4, in_features // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of the group size 64"):
        Int4Weight(packed, torch.ones(4, 1), torch.zeros(4, 1), 64)


def test_bad_formats_are_rejected() -> None:
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_int4(random_weight(4, 96), 48)
    with pytest.raises(ValueError, match="2-D int8"):
        Int8Weight(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="scales must be float16, bfloat16 or float32"):
        Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scales must be \[4\]"):
        Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match="uint8"):
        Int4Weight(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 1), torch.zeros(4, 1), 32)
    with pytest.raises(ValueError, match=r"scales must be \[4, 2\]"):
        Int4Weight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 2), 32)
    with pytest.raises(ValueError, match=r"mins must be \[4, 2\]"):
        Int4Weight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), torch.zeros(4, 1), 32)
    int_mins = torch.zeros(4, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match="mins must be float16, bfloat16 or float32"):
        Int4Weight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), int_mins, 32)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_int4(torch.full((1, 2), 16, dtype=torch.uint8))


def test_reference_linear_rejects_bad_activations() -> None:
    quantized = quantize_int8(random_weight(4, 32))
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        reference_linear(torch.zeros(2, 32, dtype=torch.int32), quantized)
    with pytest.raises(ValueError, match=r"x must be \[num_rows, 32\]"):
        reference_linear(torch.zeros(2, 31), quantized)
