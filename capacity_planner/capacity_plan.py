"""The plan: from traffic, request shape, model and GPU to GPUs, memory and cost, step by step.

Pure: `plan_capacity` takes `PlanInputs` and returns a `CapacityPlan` whose every number is
also a `PlanStep` with its formula written out with the numbers that went in, so a reader can
redo each step by hand (the articles Tollway is built from work it out the same way).

Units: bytes, seconds, tokens; a "stream" is one response being generated. Counts of GPUs are
rounded up, to whole tensor-parallel groups. The memory arithmetic is `kv_memory`'s; the
per-GPU rate and the tensor-parallel degree are `gpu_rate`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from capacity_planner.gpu_rate import gpu_rate, tensor_parallel_to_fit
from capacity_planner.kv_memory import (
    kv_bytes_per_token,
    weights_bytes,
    without_float_noise,
)
from capacity_planner.plan_inputs import PlanError, PlanInputs, UserTraffic
from capacity_planner.quantity_text import bytes_text as _bytes
from capacity_planner.quantity_text import number_text as _n

SECONDS_PER_DAY = 86_400
HOURS_PER_MONTH = 730  # 8,760 hours a year / 12


@dataclass(frozen=True)
class PlanStep:
    key: str  # the CapacityPlan field it computes
    label: str
    formula: str  # with the numbers that went in


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
    shape, model, fleet, gpu = inputs.shape, inputs.model, inputs.fleet, inputs.fleet.gpu
    steps: list[PlanStep] = []

    def step(key: str, label: str, formula: str) -> None:
        steps.append(PlanStep(key, label, formula))

    m = model.shape
    kv_token = kv_bytes_per_token(model)
    step(
        "kv_bytes_per_token",
        "KV cache per token",
        f"2 × {m.num_layers} layers × {m.num_kv_heads} KV heads × {m.head_dim} head dim × "
        f"{_n(model.kv_bytes_per_element)} B = {_bytes(kv_token)}",
    )
    weights = weights_bytes(model)
    step(
        "weights_bytes",
        "Weights",
        f"{_n(m.num_params)} params × {_n(model.weight_bytes_per_param)} B = {_bytes(weights)}",
    )
    context = shape.context_tokens
    kv_stream = math.ceil(context * kv_token)
    step(
        "kv_bytes_per_stream",
        "KV cache per stream",
        f"{_n(context)} tokens of context × {_bytes(kv_token)} = {_bytes(kv_stream)}",
    )

    traffic = inputs.traffic
    stream_seconds = shape.output_tokens / shape.stream_tokens_per_s
    if isinstance(traffic, UserTraffic):
        peak_streams = (
            traffic.daily_users * traffic.peak_active_fraction * traffic.in_flight_fraction
        )
        step(
            "peak_streams",
            "Peak concurrent streams",
            f"{_n(traffic.daily_users)} daily users × {_n(traffic.peak_active_fraction)} active "
            f"at peak × {_n(traffic.in_flight_fraction)} in flight = {_n(peak_streams)}",
        )
        peak_requests = peak_streams / stream_seconds
        step(
            "peak_requests_per_s",
            "Peak requests per second",
            f"{_n(peak_streams)} streams / ({_n(shape.output_tokens)} output tokens / "
            f"{_n(shape.stream_tokens_per_s)} tokens/s) = {_n(peak_requests)}/s",
        )
    else:
        peak_requests = traffic.requests_per_day / SECONDS_PER_DAY * traffic.peak_factor
        step(
            "peak_requests_per_s",
            "Peak requests per second",
            f"{_n(traffic.requests_per_day)} requests/day / 86,400 s × "
            f"{_n(traffic.peak_factor)} peak factor = {_n(peak_requests)}/s",
        )
        peak_streams = peak_requests * stream_seconds
        step(
            "peak_streams",
            "Peak concurrent streams",
            f"{_n(peak_requests)}/s × {_n(shape.output_tokens)} output tokens / "
            f"{_n(shape.stream_tokens_per_s)} tokens/s = {_n(peak_streams)}",
        )
    peak_output = peak_streams * shape.stream_tokens_per_s
    step(
        "peak_output_tokens_per_s",
        "Peak output tokens/s",
        f"{_n(peak_streams)} streams × {_n(shape.stream_tokens_per_s)} tokens/s = "
        f"{_n(peak_output)}",
    )

    fit_degree = tensor_parallel_to_fit(fleet, weights + kv_stream)
    if fleet.tensor_parallel is not None and fleet.tensor_parallel < fit_degree:
        raise PlanError(
            f"--tensor-parallel {fleet.tensor_parallel} is too small: the weights and one "
            f"stream's KV cache need {fit_degree} {gpu.name}"
        )
    throughput, tensor_parallel, how, chosen = gpu_rate(
        inputs, weights, kv_token, kv_stream, fit_degree
    )
    step(
        "tensor_parallel",
        "Tensor-parallel degree",
        f"the weights fit from the smallest power of 2 with degree × "
        f"{_n(fleet.usable_memory_fraction)} × {_bytes(gpu.memory_bytes)} ≥ {_bytes(weights)} "
        f"weights + one stream's {_bytes(kv_stream)}: {fit_degree}{chosen}",
    )
    step("gpu_output_tokens_per_s", "Per-GPU output tokens/s", how)
    streams_per_gpu = throughput.output_tokens_per_s / throughput.stream_tokens_per_s
    step(
        "streams_per_gpu",
        "Streams per GPU",
        f"{_n(throughput.output_tokens_per_s)} tokens/s / "
        f"{_n(throughput.stream_tokens_per_s)} tokens/s per stream = {_n(streams_per_gpu)}",
    )

    gpus_at_peak = _whole_groups(peak_output / throughput.output_tokens_per_s, tensor_parallel)
    step(
        "gpus_at_peak",
        "GPUs at peak",
        f"{_n(peak_output)} / {_n(throughput.output_tokens_per_s)} tokens/s, up to whole "
        f"groups of {tensor_parallel} = {gpus_at_peak}",
    )
    gpus_with_headroom = _whole_groups(
        gpus_at_peak * (1 + fleet.headroom_fraction), tensor_parallel
    )
    step(
        "gpus_with_headroom",
        "GPUs with headroom",
        f"{gpus_at_peak} × (1 + {_n(fleet.headroom_fraction)}) = {gpus_with_headroom}",
    )

    kv_gpu = math.ceil(streams_per_gpu * context * kv_token)
    step(
        "kv_bytes_per_gpu",
        "KV cache per GPU",
        f"{_n(streams_per_gpu)} streams × {_n(context)} tokens × {_bytes(kv_token)} = "
        f"{_bytes(kv_gpu)}",
    )
    memory_gpu = math.ceil(weights / tensor_parallel) + kv_gpu
    usable = math.floor(fleet.usable_memory_fraction * gpu.memory_bytes)
    fits = memory_gpu <= usable
    step(
        "fits",
        "Memory per GPU",
        f"{_bytes(weights)} / {tensor_parallel} + {_bytes(kv_gpu)} = {_bytes(memory_gpu)} "
        f"{'≤' if fits else '>'} {_n(fleet.usable_memory_fraction)} × "
        f"{_bytes(gpu.memory_bytes)} = {_bytes(usable)}: {'fits' if fits else 'does not fit'}",
    )

    prefill_fraction = 1 - shape.cached_fraction
    prefill_tokens = peak_requests * shape.prompt_tokens * prefill_fraction
    prefill_share = 2 * m.num_params * prefill_tokens / (gpus_at_peak * gpu.flops_per_s)
    step(
        "prefill_share_per_gpu",
        "Prefill share of each GPU",
        f"2 × {_n(m.num_params)} params × {_n(peak_requests)}/s × {_n(shape.prompt_tokens)} "
        f"prompt tokens × {_n(prefill_fraction)} uncached / ({gpus_at_peak} GPUs × "
        f"{_n(gpu.flops_per_s)} FLOP/s) = {prefill_share:.1%}",
    )
    prompt_p90 = shape.prompt_tokens_p90 or shape.prompt_tokens
    prefill_s = (
        2 * m.num_params * prompt_p90 * prefill_fraction / (tensor_parallel * gpu.flops_per_s)
    )
    meets_ttft = prefill_s <= shape.ttft_s
    step(
        "meets_ttft_target",
        "Prefill of a p90 prompt",
        f"2 × {_n(m.num_params)} params × {_n(prompt_p90)} tokens × {_n(prefill_fraction)} / "
        f"({tensor_parallel} × {_n(gpu.flops_per_s)} FLOP/s) = {prefill_s * 1000:,.1f} ms "
        f"{'≤' if meets_ttft else '>'} TTFT target {shape.ttft_s * 1000:,.0f} ms (before "
        "queueing)",
    )

    cost_per_million = cost_per_month = None
    if fleet.dollars_per_gpu_hour is not None:
        dollars = fleet.dollars_per_gpu_hour
        tokens_per_hour = throughput.output_tokens_per_s * 3600 * fleet.average_utilization
        cost_per_million = dollars / tokens_per_hour * 1e6
        step(
            "cost_per_million_output_tokens",
            "Cost per million output tokens",
            f"${_n(dollars)}/h / ({_n(throughput.output_tokens_per_s)} tokens/s × 3,600 s × "
            f"{_n(fleet.average_utilization)} utilization) × 10^6 = ${cost_per_million:,.2f}",
        )
        cost_per_month = gpus_with_headroom * dollars * HOURS_PER_MONTH
        step(
            "cost_per_month",
            "Cost per month",
            f"{gpus_with_headroom} GPUs × ${_n(dollars)}/h × {HOURS_PER_MONTH} h = "
            f"${cost_per_month:,.0f}",
        )

    return CapacityPlan(
        kv_bytes_per_token=kv_token,
        weights_bytes=weights,
        context_tokens=context,
        kv_bytes_per_stream=kv_stream,
        peak_requests_per_s=peak_requests,
        peak_streams=peak_streams,
        peak_output_tokens_per_s=peak_output,
        tensor_parallel=tensor_parallel,
        gpu_output_tokens_per_s=throughput.output_tokens_per_s,
        gpu_throughput_source=throughput.source,
        streams_per_gpu=streams_per_gpu,
        gpus_at_peak=gpus_at_peak,
        gpus_with_headroom=gpus_with_headroom,
        kv_bytes_per_gpu=kv_gpu,
        memory_bytes_per_gpu=memory_gpu,
        usable_memory_bytes_per_gpu=usable,
        fits=fits,
        peak_prefill_tokens_per_s=prefill_tokens,
        prefill_share_per_gpu=prefill_share,
        prefill_seconds_p90=prefill_s,
        meets_ttft_target=meets_ttft,
        cost_per_million_output_tokens=cost_per_million,
        cost_per_month=cost_per_month,
        steps=tuple(steps),
    )


def _whole_groups(gpus: float, group: int) -> int:
    """At least ``gpus`` GPUs, in whole tensor-parallel groups."""
    return math.ceil(without_float_noise(gpus / group)) * group
