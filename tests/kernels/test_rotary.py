"""Rotary embedding, native and PyTorch paths, against Hugging Face's formula."""

from __future__ import annotations

import pytest
import torch

from backend_engine.models.rotary import RotaryEmbedding
from kernels import rotary
from kernels.cpu_build import DISABLE_ENV, find_compiler

needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cat([cos, cos], dim=-1) + rotated * torch.cat([sin, sin], dim=-1)


def qkv_case(
    num_tokens: int, head_dim: int = 64, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q/k/v projection output (8 + 2 + 2 heads) and the angles of its positions."""
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    qkv = torch.randn(num_tokens, 12, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 4096, 500000.0, None, torch.device("cpu"))(
        positions, dtype
    )
    return qkv, cos, sin


@needs_compiler
def test_native_library_builds_here() -> None:
    assert rotary.native_library() is not None


@pytest.mark.parametrize("num_tokens", [0, 1, 16, 200])
@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_queries_and_keys_rotate_in_place_bit_for_bit(num_tokens: int, head_dim: int) -> None:
    """The q and k heads of a q/k/v projection: a strided view, rotated where it lies."""
    qkv, cos, sin = qkv_case(num_tokens, head_dim)
    qk = qkv[:, :10]
    want = hf_rotary(qk.clone(), cos, sin)
    v_before = qkv[:, 10:].clone()
    got = rotary.apply_rotary(qk, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, 10:], v_before)  # values untouched
    if rotary.native_library() is not None:
        assert got.data_ptr() == qk.data_ptr()  # in place


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_takes_the_pytorch_path(dtype: torch.dtype) -> None:
    qkv, cos, sin = qkv_case(5, dtype=dtype)
    before = qkv.clone()
    got = rotary.apply_rotary(qkv[:, :10], cos, sin)
    assert torch.equal(got, hf_rotary(before[:, :10], cos, sin))
    assert torch.equal(qkv, before)  # a new tensor, x untouched


def test_native_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "reference")
    rotary.native_library.cache_clear()
    try:
        assert rotary.native_library() is None
        qkv, cos, sin = qkv_case(16)
        before = qkv.clone()
        got = rotary.apply_rotary(qkv[:, :10], cos, sin)
        assert torch.equal(got, hf_rotary(before[:, :10], cos, sin))
        assert torch.equal(qkv, before)
    finally:
        monkeypatch.delenv(DISABLE_ENV)
        rotary.native_library.cache_clear()
