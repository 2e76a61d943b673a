"""The int8/int4 weight formats: quantization error bounds, the int4 packing, bad inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.quantized_weights import (
    INT4_OFFSET,
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


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_is_exact(group_size: int) -> None:
    weight = random_weight(7, 192)
    codes, scales = int4_codes(weight, group_size)
    expected = (codes.float() - INT4_OFFSET) * scales.repeat_interleave(group_size, dim=1)
    packed = quantize_int4(weight, group_size)
    assert torch.equal(unpack_int4(packed.packed), codes)
    assert torch.equal(dequantize(packed), expected)


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_error_is_within_half_a_step(group_size: int) -> None:
    weight = random_weight(9, 128, seed=2)
    quantized = quantize_int4(weight, group_size)
    step = quantized.scales.abs().repeat_interleave(group_size, dim=1)
    error = (dequantize(quantized) - weight).abs()
    # rounding: half a step; code 15 also holds values up to +8 steps (clamped): one step
    is_clamped = unpack_int4(quantized.packed) == 2 * INT4_OFFSET - 1
    assert bool((error[~is_clamped] <= step[~is_clamped] / 2 + 1e-6).all())
    assert bool((error <= step + 1e-6).all())
    # each group's value of largest magnitude is code 0, exactly
    groups = weight.view(9, -1, group_size)
    extreme = groups.gather(2, groups.abs().argmax(2, keepdim=True)).squeeze(2)
    assert torch.allclose(-INT4_OFFSET * quantized.scales, extreme, rtol=0, atol=1e-6)


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


def test_reference_linear_is_within_the_quantization_error() -> None:
    """|x @ (W' - W).T| <= |x| @ (largest error per weight).T: half a step for int8, one for
    int4 (clamped code 15)."""
    weight = random_weight(5, 64, seed=4)
    x = random_weight(3, 64, seed=5)
    exact = x @ weight.T
    int8, int4 = quantize_int8(weight), quantize_int4(weight, 32)
    int8_bound = x.abs() @ (int8.scales[:, None] / 2).expand(5, 64).T
    int4_bound = x.abs() @ int4.scales.abs().repeat_interleave(32, dim=1).T
    for quantized, bound in ((int8, int8_bound), (int4, int4_bound)):
        error = (reference_linear(x, quantized) - exact).abs()
        assert bool((error <= bound + 1e-5).all())
        assert float(error.max()) > 0  # the formats do round


@pytest.mark.parametrize("in_features", [48, 100])
def test_int4_needs_whole_groups(in_features: int) -> None:
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        quantize_int4(random_weight(4, in_features), 32)
    with pytest.raises(ValueError, match="multiple of the group size 64"):
        Int4Weight(torch.zeros(4, in_features // 2, dtype=torch.uint8), torch.ones(4, 1), 64)


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
        Int4Weight(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 1), 32)
    with pytest.raises(ValueError, match=r"scales must be \[4, 2\]"):
        Int4Weight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), 32)
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
