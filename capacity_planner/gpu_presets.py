"""GPUs to plan for: memory, HBM bandwidth and dense bf16 FLOP/s, as their vendor publishes them.

Each preset names its datasheet. Memory is the datasheet's figure in decimal bytes ("80GB" is
80e9 bytes; the device reports a little more, which ``--usable-memory-fraction`` leaves aside
anyway). FLOP/s are dense bf16 tensor-core figures: datasheets print the sparse ones (twice as
high, marked with an asterisk) first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 10**9
TB = 10**12
TFLOPS = 10**12


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: what the plan reads from it."""

    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float  # HBM (or GDDR) bandwidth
    flops_per_s: float  # dense bf16 tensor-core peak
    source: str  # where the figures come from

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "bandwidth_bytes_per_s", "flops_per_s"):
            value = getattr(self, field)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"the GPU's {field} must be a finite number above 0, got {value}")

    @property
    def ridge_flops_per_byte(self) -> float:
        """FLOPs per byte read above which a kernel is compute-bound (the roofline's ridge)."""
        return self.flops_per_s / self.bandwidth_bytes_per_s


GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            "h100-80gb",
            memory_bytes=80 * GB,
            bandwidth_bytes_per_s=3.35 * TB,
            flops_per_s=989 * TFLOPS,  # 1,979 with sparsity
            source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM "
            "(https://www.nvidia.com/en-us/data-center/h100/)",
        ),
        GpuSpec(
            "h200-141gb",
            memory_bytes=141 * GB,
            bandwidth_bytes_per_s=4.8 * TB,
            flops_per_s=989 * TFLOPS,  # 1,979 with sparsity
            source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM "
            "(https://www.nvidia.com/en-us/data-center/h200/)",
        ),
        GpuSpec(
            "a100-80gb",
            memory_bytes=80 * GB,
            bandwidth_bytes_per_s=2.039 * TB,
            flops_per_s=312 * TFLOPS,  # 624 with sparsity
            source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM "
            "(https://www.nvidia.com/en-us/data-center/a100/)",
        ),
        GpuSpec(
            "l40s",
            memory_bytes=48 * GB,
            bandwidth_bytes_per_s=0.864 * TB,
            flops_per_s=362.05 * TFLOPS,  # 733 with sparsity
            source="NVIDIA L40S GPU datasheet (https://www.nvidia.com/en-us/data-center/l40s/)",
        ),
        GpuSpec(
            "l4",
            memory_bytes=24 * GB,
            bandwidth_bytes_per_s=0.3 * TB,
            flops_per_s=121 * TFLOPS,  # 242 with sparsity
            source="NVIDIA L4 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/l4/)",
        ),
    )
}


def gpu_preset(name: str) -> GpuSpec:
    """The preset called ``name`` (case-insensitive); a `ValueError` naming the presets if none."""
    spec = GPU_PRESETS.get(name.lower())
    if spec is None:
        raise ValueError(f"unknown GPU preset {name!r}; presets: {', '.join(GPU_PRESETS)}")
    return spec
