"""The fleet: its tensor-parallel degree and per-GPU rate (`gpu_rate`), the streams a GPU runs
at that rate, and the GPUs the peak needs, in whole tensor-parallel groups, with headroom."""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity_planner.gpu_rate import gpu_rate, tensor_parallel_to_fit
from capacity_planner.kv_memory import ModelMemory, without_float_noise
from capacity_planner.peak_traffic import PeakTraffic
from capacity_planner.plan_inputs import GpuThroughput, PlanError, PlanInputs
from capacity_planner.plan_step import PlanStep
from capacity_planner.quantity_text import bytes_text as _bytes
from capacity_planner.quantity_text import number_text as _n


@dataclass(frozen=True)
class FleetSize:
    tensor_parallel: int
    gpu_throughput: GpuThroughput
    streams_per_gpu: float
    gpus_at_peak: int
    gpus_with_headroom: int
    steps: tuple[PlanStep, ...]


def fleet_size(inputs: PlanInputs, memory: ModelMemory, peak: PeakTraffic) -> FleetSize:
    """`PlanError` when the fleet's ``tensor_parallel`` is too small to hold the model."""
    fleet, gpu = inputs.fleet, inputs.fleet.gpu
    weights, kv_stream = memory.weights_bytes, memory.kv_bytes_per_stream
    fit_degree = tensor_parallel_to_fit(fleet, weights + kv_stream)
    if fleet.tensor_parallel is not None and fleet.tensor_parallel < fit_degree:
        raise PlanError(
            f"--tensor-parallel {fleet.tensor_parallel} is too small: the weights and one "
            f"stream's KV cache need {fit_degree} {gpu.name}"
        )
    throughput, tensor_parallel, how, chosen = gpu_rate(
        inputs, weights, memory.kv_bytes_per_token, kv_stream, fit_degree
    )
    rate = throughput.output_tokens_per_s
    streams_per_gpu = rate / throughput.stream_tokens_per_s
    gpus_at_peak = _whole_groups(peak.peak_output_tokens_per_s / rate, tensor_parallel)
    gpus_with_headroom = _whole_groups(
        gpus_at_peak * (1 + fleet.headroom_fraction), tensor_parallel
    )
    steps = (
        PlanStep(
            "tensor_parallel",
            "Tensor-parallel degree",
            f"the weights fit from the smallest power of 2 with degree × "
            f"{_n(fleet.usable_memory_fraction)} × {_bytes(gpu.memory_bytes)} ≥ "
            f"{_bytes(weights)} weights + one stream's {_bytes(kv_stream)}: {fit_degree}{chosen}",
        ),
        PlanStep("gpu_output_tokens_per_s", "Per-GPU output tokens/s", how),
        PlanStep(
            "streams_per_gpu",
            "Streams per GPU",
            f"{_n(rate)} tokens/s / {_n(throughput.stream_tokens_per_s)} tokens/s per stream = "
            f"{_n(streams_per_gpu)}",
        ),
        PlanStep(
            "gpus_at_peak",
            "GPUs at peak",
            f"{_n(peak.peak_output_tokens_per_s)} / {_n(rate)} tokens/s, up to whole groups of "
            f"{tensor_parallel} = {gpus_at_peak}",
        ),
        PlanStep(
            "gpus_with_headroom",
            "GPUs with headroom",
            f"{gpus_at_peak} × (1 + {_n(fleet.headroom_fraction)}) = {gpus_with_headroom}",
        ),
    )
    return FleetSize(
        tensor_parallel, throughput, streams_per_gpu, gpus_at_peak, gpus_with_headroom, steps
    )


def _whole_groups(gpus: float, group: int) -> int:
    """At least ``gpus`` GPUs, in whole tensor-parallel groups."""
    return math.ceil(without_float_noise(gpus / group)) * group
