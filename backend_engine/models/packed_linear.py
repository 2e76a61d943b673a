"""Linear layers with weights prepacked for oneDNN: the CPU path's matmuls.

PyTorch's default CPU ``F.linear`` goes through MKL's sgemm, which repacks the weight on
every call and, on AMD processors, does not pick its fastest code path. oneDNN (bundled
with PyTorch, the path ``torch.compile`` takes for frozen CPU linears) can pack a weight
once into its blocked layout and reuse it: on the 2-core AMD EPYC development machine the
demo model's matmuls run 2.2x faster at 16 rows, 1.6x at 64 and 1.2x for prefill-sized
batches (``bench/offline_throughput.py`` shows the effect on the whole engine).

Packing happens once after the weights are loaded, and each packed layer is checked against
``F.linear`` on a probe before it is used; results equal ``F.linear`` up to float rounding
(the accumulation order differs). When oneDNN is not available, or a weight's dtype or
device is not one it packs, or the probe disagrees, the layers are left as they are.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# oneDNN picks the blocked layout for this many rows; measured: one layout packed for 64
# rows is within a few percent of the best for every batch from 1 to 2048 rows.
_PACKING_ROWS_HINT = 64
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dim() != 2:
            leading = x.shape[:-1]
            return self.forward(x.reshape(-1, self.in_features)).view(*leading, -1)
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def can_pack(linear: nn.Linear) -> bool:
    weight = linear.weight
    if not torch.backends.mkldnn.is_available() or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype in _PACKABLE_DTYPES


def _agrees_with_f_linear(linear: nn.Linear, packed: PackedLinear) -> bool:
    """A probe through the packed layer matches ``F.linear`` (guards odd builds and CPUs)."""
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(linear.weight.dtype)
    with torch.inference_mode():
        want = F.linear(probe, linear.weight, linear.bias).float()
        got = packed(probe).float()
    tolerance = 1e-4 if linear.weight.dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got, want, rtol=tolerance, atol=tolerance * float(want.abs().max())))


def pack_linears(module: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` inside ``module`` in place; returns how many."""
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and can_pack(child)
    ]
    try:
        packed = [PackedLinear(child) for _, _, child in targets]
        agree = all(
            _agrees_with_f_linear(c, p) for (_, _, c), p in zip(targets, packed, strict=True)
        )
    except RuntimeError as error:  # an op missing from this build: keep plain linears
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", error)
        return 0
    if not agree:
        logger.warning("oneDNN packed linears disagree with F.linear here; not packing")
        return 0
    for (parent, name, _), layer in zip(targets, packed, strict=True):
        setattr(parent, name, layer)
    return len(targets)
