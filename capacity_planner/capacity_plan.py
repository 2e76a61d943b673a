"""The plan: from traffic, request shape, model and GPU to GPUs, memory and cost, step by step.

Pure: `plan_capacity` takes `PlanInputs` and returns a `CapacityPlan` whose every number is
also a `PlanStep` with its formula written out with the numbers that went in, so a reader can
redo each step by hand (the articles Tollway is built from work it out the same way).

Units: bytes, seconds, tokens; a "stream" is one response being generated. Each concern is
its own module, in the order the plan takes them: the model's memory (`kv_memory`), the peak
traffic (`peak_traffic`), the fleet (`fleet_size`, over `gpu_rate`'s per-GPU rate and
tensor-parallel degree), what each GPU then holds (`kv_memory`), the prefill load
(`prefill_load`) and the cost (`fleet_cost`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from capacity_planner.fleet_cost import fleet_cost
from capacity_planner.fleet_size import fleet_size
from capacity_planner.kv_memory import gpu_memory, model_memory
from capacity_planner.peak_traffic import peak_traffic
from capacity_planner.plan_inputs import PlanInputs
from capacity_planner.plan_step import PlanStep
from capacity_planner.prefill_load import prefill_load


@dataclass(frozen=True)
class CapacityPlan:
    kv_bytes_per_token: int
    weights_bytes: int
    context_tokens: float
    kv_bytes_per_stream: int
    peak_requests_per_s: float
    peak_streams: float
    peak_output_tokens_per_s: float
    tensor_parallel: int
    gpu_output_tokens_per_s: float
    gpu_throughput_source: str  # "roofline", "given" or "measured"
    streams_per_gpu: float
    gpus_at_peak: int
    gpus_with_headroom: int
    kv_bytes_per_gpu: int
    memory_bytes_per_gpu: int
    usable_memory_bytes_per_gpu: int
    fits: bool
    peak_prefill_tokens_per_s: float
    prefill_share_per_gpu: float
    prefill_seconds_p90: float
    meets_ttft_target: bool
    cost_per_million_output_tokens: float | None
    cost_per_month: float | None
    steps: tuple[PlanStep, ...]

    def to_json_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["steps"] = [dataclasses.asdict(step) for step in self.steps]
        return data


def plan_capacity(inputs: PlanInputs) -> CapacityPlan:
    """The plan for ``inputs``; `PlanError` when no fleet of these GPUs can serve them."""
    memory = model_memory(inputs.model, inputs.shape)
    peak = peak_traffic(inputs.traffic, inputs.shape)
    fleet = fleet_size(inputs, memory, peak)
    per_gpu = gpu_memory(inputs.fleet, memory, fleet.streams_per_gpu, fleet.tensor_parallel)
    prefill = prefill_load(inputs, peak, fleet)
    cost = fleet_cost(inputs.fleet, fleet)
    return CapacityPlan(
        kv_bytes_per_token=memory.kv_bytes_per_token,
        weights_bytes=memory.weights_bytes,
        context_tokens=memory.context_tokens,
        kv_bytes_per_stream=memory.kv_bytes_per_stream,
        peak_requests_per_s=peak.peak_requests_per_s,
        peak_streams=peak.peak_streams,
        peak_output_tokens_per_s=peak.peak_output_tokens_per_s,
        tensor_parallel=fleet.tensor_parallel,
        gpu_output_tokens_per_s=fleet.gpu_throughput.output_tokens_per_s,
        gpu_throughput_source=fleet.gpu_throughput.source,
        streams_per_gpu=fleet.streams_per_gpu,
        gpus_at_peak=fleet.gpus_at_peak,
        gpus_with_headroom=fleet.gpus_with_headroom,
        kv_bytes_per_gpu=per_gpu.kv_bytes_per_gpu,
        memory_bytes_per_gpu=per_gpu.memory_bytes_per_gpu,
        usable_memory_bytes_per_gpu=per_gpu.usable_memory_bytes_per_gpu,
        fits=per_gpu.fits,
        peak_prefill_tokens_per_s=prefill.peak_prefill_tokens_per_s,
        prefill_share_per_gpu=prefill.prefill_share_per_gpu,
        prefill_seconds_p90=prefill.prefill_seconds_p90,
        meets_ttft_target=prefill.meets_ttft_target,
        cost_per_million_output_tokens=cost.cost_per_million_output_tokens,
        cost_per_month=cost.cost_per_month,
        steps=(
            *memory.steps,
            *peak.steps,
            *fleet.steps,
            *per_gpu.steps,
            *prefill.steps,
            *cost.steps,
        ),
    )
