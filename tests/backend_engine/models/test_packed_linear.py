"""oneDNN-prepacked linear layers equal ``F.linear`` up to float rounding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_engine.models.packed_linear import (
    NATIVE_MAX_ROWS,
    PackedLinear,
    can_pack,
    pack_linears,
)
from kernels import cpu_linear
from kernels.cpu_build import DISABLE_ENV

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(
            packed(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5
        )


def test_packed_linear_takes_any_leading_shape_and_strided_rows() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    x = torch.randn(2, 5, 64)[..., :32]  # not contiguous
    with torch.inference_mode():
        got = packed(x)
        assert got.shape == (2, 5, 48)
        torch.testing.assert_close(got, linear(x), atol=1e-5, rtol=1e-5)


def test_bfloat16_weights_pack_too() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = PackedLinear(linear)(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, linear(x), atol=2e-2, rtol=2e-2)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8)))
        self.fp16_head = nn.Linear(8, 8, dtype=torch.float16)  # oneDNN does not pack fp16


def test_pack_linears_replaces_every_packable_linear_in_place() -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(4, 16)
    with torch.inference_mode():
        expected = model.body(x)
        assert pack_linears(model) == 2
        assert isinstance(model.body[0], PackedLinear)
        assert isinstance(model.body[2][0], PackedLinear)
        assert type(model.fp16_head) is nn.Linear
        assert not can_pack(model.fp16_head)
        torch.testing.assert_close(model.body(x), expected, atol=1e-5, rtol=1e-5)


needs_native = pytest.mark.skipif(
    not cpu_linear.is_available(), reason="no native few-rows linear kernel here"
)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_run_the_native_kernel_and_more_run_onednn(
    bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(50, 71, bias=bias)  # K % 32 != 0, N odd
    packed = PackedLinear(linear)
    assert packed.native_weight is not None
    native_rows: list[int] = []
    native = cpu_linear.small_batch_linear

    def spy(x: torch.Tensor, *args: Any) -> torch.Tensor:
        native_rows.append(x.shape[0])
        return native(x, *args)

    monkeypatch.setattr(cpu_linear, "small_batch_linear", spy)
    with torch.inference_mode():
        for rows in (1, 2, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 64):
            x = torch.randn(rows, 50)
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert native_rows == [1, 2, NATIVE_MAX_ROWS]


def test_native_kernels_switched_off_leave_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "reference")
    cpu_linear.native_library.cache_clear()
    try:
        linear = nn.Linear(32, 48)
        packed = PackedLinear(linear)
        assert packed.native_weight is None
        x = torch.randn(2, 32)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.delenv(DISABLE_ENV)
        cpu_linear.native_library.cache_clear()


@needs_native
def test_a_native_path_that_disagrees_with_f_linear_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe covers the native path: a kernel reading the wrong layout would fail it,
    and the layer keeps oneDNN for every batch."""
    torch.manual_seed(0)
    model = TwoLayers()
    original = model.body[0]
    monkeypatch.setattr(
        cpu_linear,
        "small_batch_linear",
        lambda x, weight, bias: torch.zeros(x.shape[0], weight.out_features),
    )
    assert pack_linears(model) == 2
    first = model.body[0]
    assert isinstance(first, PackedLinear)
    assert first.native_weight is None
    x = torch.randn(1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(first(x), original(x), atol=1e-5, rtol=1e-5)
