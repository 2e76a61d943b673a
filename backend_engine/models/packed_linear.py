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

A float32 layer called with at most ``NATIVE_MAX_ROWS`` rows (decode steps of up to that
many sequences) runs :mod:`kernels.cpu_linear` instead: a C kernel that reads the same
packed buffer, so each weight is still stored once. The demo model's 33 matmuls take
1.2-2.2 ms there at 1-2 rows where oneDNN takes 2.5-3.6 ms, and a decode step of 1, 2, 8
and 16 sequences goes from 6.4, 6.9, 7.8 and 10.1 ms to 4.0, 3.9, 6.0 and 9.1 ms. The
kernel was ahead up to 64 rows on the development machine; past its 16 rows oneDNN's
cache blocking is the safer bet. Each layer's native path is probed against ``F.linear``
too, and a layer whose probe disagrees keeps oneDNN for every batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear

logger = logging.getLogger(__name__)

# oneDNN picks the blocked layout for this many rows; measured: one layout packed for 64
# rows is within a few percent of the best for every batch from 1 to 2048 rows.
_PACKING_ROWS_HINT = 64
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
NATIVE_MAX_ROWS = cpu_linear.MAX_ROWS  # measured ahead of oneDNN at every count up to this
_PROBE_ROWS = 3


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # The same buffer, for the native few-rows kernel (None: oneDNN for every batch).
        self.native_weight = cpu_linear.blocked_weight(self.packed_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dim() != 2:
            leading = x.shape[:-1]
            return self.forward(x.reshape(-1, self.in_features)).view(*leading, -1)
        if not x.is_contiguous():
            x = x.contiguous()
        if self.native_weight is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            return cpu_linear.small_batch_linear(x, self.native_weight, self.bias)
        return self.forward_onednn(x)

    def forward_onednn(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] contiguous
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        native = "" if self.native_weight is None else f" (native up to {NATIVE_MAX_ROWS} rows)"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"packed=oneDNN{native}"
        )


def can_pack(linear: nn.Linear) -> bool:
    weight = linear.weight
    if not torch.backends.mkldnn.is_available() or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype in _PACKABLE_DTYPES


def _agrees_with_f_linear(
    linear: nn.Linear, forward: Callable[[torch.Tensor], torch.Tensor]
) -> bool:
    """A probe through one of a packed layer's paths matches ``F.linear`` (guards odd builds,
    CPUs and oneDNN layouts)."""
    probe = torch.randn(_PROBE_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(linear.weight.dtype)
    with torch.inference_mode():
        want = F.linear(probe, linear.weight, linear.bias).float()
        got = forward(probe).float()
    tolerance = 1e-4 if linear.weight.dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got, want, rtol=tolerance, atol=tolerance * float(want.abs().max())))


def _drop_native_unless_it_agrees(linear: nn.Linear, packed: PackedLinear) -> None:
    native_weight = packed.native_weight
    if native_weight is None:
        return
    if not _agrees_with_f_linear(
        linear, lambda x: cpu_linear.small_batch_linear(x, native_weight, packed.bias)
    ):
        logger.warning("the native small-batch linear disagrees with F.linear; using oneDNN")
        packed.native_weight = None


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
            _agrees_with_f_linear(c, p.forward_onednn)
            for (_, _, c), p in zip(targets, packed, strict=True)
        )
        for (_, _, child), layer in zip(targets, packed, strict=True):
            _drop_native_unless_it_agrees(child, layer)
    except RuntimeError as error:  # an op missing from this build: keep plain linears
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", error)
        return 0
    if not agree:
        logger.warning("oneDNN packed linears disagree with F.linear here; not packing")
        return 0
    for (parent, name, _), layer in zip(targets, packed, strict=True):
        setattr(parent, name, layer)
    return len(targets)
