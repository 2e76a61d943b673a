"""GPTQ's int4 codes: a smaller output error than round-to-nearest on correlated inputs, the
same format (codes 0..15 on each group's float16 grid), and the same result every run."""

from __future__ import annotations

import pytest
import torch

from kernels.gptq_quantization import gptq_codes
from kernels.int4_quantization import searched_codes
from kernels.quantized_weights import int4_codes


def correlated_inputs(num_tokens: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """``[num_tokens, in_features]`` with correlated columns and a few loud ones, as a
    layer's real inputs have (the case where GPTQ's error feedback pays)."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(in_features // 4, in_features, generator=gen)
    x = torch.randn(num_tokens, in_features // 4, generator=gen) @ mixing
    x += 0.1 * torch.randn(num_tokens, in_features, generator=gen)
    loudness = torch.ones(in_features)
    loudness[torch.randperm(in_features, generator=gen)[:4]] = 8.0
    return x * loudness


def layer(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight [24, 128], calibration inputs, held-out inputs from the same distribution)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(24, 128, generator=gen) * 0.05
    inputs = correlated_inputs(1024, 128, seed=2)
    return weight, inputs[:512], inputs[512:]


def hessian(x: torch.Tensor) -> torch.Tensor:  # [K, K]
    return 2 * x.T @ x / x.shape[0]


def dequantized(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    scale = scales.float().repeat_interleave(group_size, dim=1)  # [N, K]
    minimum = mins.float().repeat_interleave(group_size, dim=1)
    return codes.float() * scale + minimum


def output_error(weight: torch.Tensor, quantized: torch.Tensor, x: torch.Tensor) -> float:
    return float(torch.linalg.norm(x @ weight.T - x @ quantized.T))


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("group_size", [32, 64])
def test_gptq_output_error_is_lower_than_round_to_nearest(group_size: int, act_order: bool) -> None:
    weight, calibration, held_out = layer()
    result = gptq_codes(
        weight, hessian(calibration), group_size, torch.float16, act_order=act_order
    )
    gptq = dequantized(*result, group_size)
    rtn = dequantized(*int4_codes(weight, group_size, torch.float16), group_size)
    # on the calibration inputs and on inputs it never saw
    for x in (calibration, held_out):
        assert output_error(weight, gptq, x) < 0.8 * output_error(weight, rtn, x)


def test_gptq_codes_are_the_int4_format_on_float16_grids() -> None:
    weight, calibration, _ = layer()
    codes, scales, mins = gptq_codes(weight, hessian(calibration), 64, torch.float16)
    assert codes.dtype == torch.uint8
    assert tuple(codes.shape) == (24, 128)
    assert int(codes.max()) <= 15
    assert scales.dtype == mins.dtype == torch.float16
    assert tuple(scales.shape) == tuple(mins.shape) == (24, 2)
    assert bool((scales >= 0).all())


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_is_deterministic(act_order: bool) -> None:
    weight, calibration, _ = layer()
    first = gptq_codes(weight, hessian(calibration), 32, torch.float16, act_order=act_order)
    second = gptq_codes(
        weight.clone(), hessian(calibration).clone(), 32, torch.float16, act_order=act_order
    )
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_gptq_leaves_its_inputs_alone_and_survives_unseen_inputs() -> None:
    weight, calibration, _ = layer()
    h = hessian(calibration)
    h[5, :] = h[:, 5] = 0.0  # input 5 never active in the calibration text
    weight_before, h_before = weight.clone(), h.clone()
    codes, scales, mins = gptq_codes(weight, h, 32, torch.float16)
    assert torch.equal(weight, weight_before)
    assert torch.equal(h, h_before)
    assert bool(torch.isfinite(dequantized(codes, scales, mins, 32)).all())


def test_gptq_refuses_a_hessian_of_another_shape() -> None:
    weight, calibration, _ = layer()
    with pytest.raises(ValueError, match="Hessian must be"):
        gptq_codes(weight, hessian(calibration)[:64, :64], 32, torch.float16)


def test_weighted_search_fits_the_important_columns_better() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 64, generator=gen) * 0.05
    importance = torch.ones(64)
    importance[::8] = 100.0  # a few loud inputs

    def weighted_error(result: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
        residual = dequantized(*result, 32) - weight
        return float((residual.square() * importance).sum())

    plain = searched_codes(weight, 32, torch.float16)
    weighted = searched_codes(weight, 32, torch.float16, importance)
    assert weighted_error(weighted) < 0.9 * weighted_error(plain)
    # equal weights are no weights
    ones = searched_codes(weight, 32, torch.float16, torch.ones(64))
    for a, b in zip(ones, plain, strict=True):
        assert torch.equal(a, b)
