"""oneDNN-prepacked linear layers equal ``F.linear`` up to float rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_engine.models.packed_linear import PackedLinear, can_pack, pack_linears

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
        assert type(model.fp16_head) is nn.Linear and not can_pack(model.fp16_head)
        torch.testing.assert_close(model.body(x), expected, atol=1e-5, rtol=1e-5)
