"""The fused add + RMSNorm kernel against Hugging Face's arithmetic, and its fallbacks."""

from __future__ import annotations

import pytest
import torch

from kernels import rms_norm
from kernels.cpu_build import DISABLE_ENV, find_compiler

needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, step by step."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def case(rows: int, hidden: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


@needs_compiler
def test_native_library_builds_here() -> None:
    assert rms_norm.native_library() is not None


# 1 row and few rows (one thread), many rows (split over threads); odd widths.
SHAPES = [(1, 512), (16, 512), (64, 768), (300, 96), (5, 33), (0, 64)]


@pytest.mark.parametrize(("rows", "hidden"), SHAPES)
def test_rms_norm_matches_hugging_face(rows: int, hidden: int) -> None:
    x, _, weight = case(rows, hidden)
    got = rms_norm.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, hf_rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("rows", "hidden"), SHAPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(rows: int, hidden: int) -> None:
    x, residual, weight = case(rows, hidden)
    want_sum = residual + x
    normed, new_residual = rms_norm.add_rms_norm(x, residual.clone(), weight, 1e-6)
    assert torch.equal(new_residual, want_sum)  # an add is exact either way
    torch.testing.assert_close(normed, hf_rms_norm(want_sum, weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_hugging_face_rounding(dtype: torch.dtype) -> None:
    """The add in the model's dtype, the norm in float32, rounded before the weight."""
    x, residual, weight = case(7, 128, dtype)
    normed, new_residual = rms_norm.add_rms_norm(x, residual, weight, 1e-5)
    want_sum = residual + x
    assert new_residual.dtype == dtype
    assert torch.equal(new_residual, want_sum)
    assert torch.equal(normed, hf_rms_norm(want_sum, weight, 1e-5))


def test_strided_input_takes_the_pytorch_path() -> None:
    x, residual, weight = case(8, 256)
    wide = torch.cat([x, x], dim=1)[:, :256]
    assert not wide.is_contiguous()
    normed, new_residual = rms_norm.add_rms_norm(wide, residual.clone(), weight, 1e-5)
    torch.testing.assert_close(new_residual, residual + x)
    torch.testing.assert_close(normed, hf_rms_norm(residual + x, weight, 1e-5))


def test_native_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "reference")
    rms_norm.native_library.cache_clear()
    try:
        assert rms_norm.native_library() is None
        x, residual, weight = case(16, 512)
        normed, new_residual = rms_norm.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(normed, hf_rms_norm(residual + x, weight, 1e-5))
    finally:
        monkeypatch.delenv(DISABLE_ENV)
        rms_norm.native_library.cache_clear()
