"""The plan: from traffic, request shape, model and GPU to GPUs, memory and cost, step by step.

Pure: `plan_capacity` takes `PlanInputs` and returns a `CapacityPlan` whose every number is
also a `PlanStep` with its formula written out with the numbers that went in, so a reader can
redo each step by hand (the articles Tollway is built from work it out the same way).

Units: bytes, seconds, tokens; a "stream" is one response being generated. Counts of GPUs are
rounded up, to whole tensor-parallel groups.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from gateway.capacity.plan_inputs import (
    FleetSpec,
    GpuThroughput,
    ModelSpec,
    PlanInputs,
    UserTraffic,
)
from gateway.capacity.quantity_text import bytes_text as _bytes
from gateway.capacity.quantity_text import number_text as _n
from gateway.capacity.roofline import DecodeBatch, DecodeHardware, DecodeLoad, largest_batch

SECONDS_PER_DAY = 86_400
HOURS_PER_MONTH = 730  # 8,760 hours a year / 12
# A larger tensor-parallel group must at least reach this share of the best per-GPU rate.
GOOD_ENOUGH_TP_RATE = 0.5


class PlanError(ValueError):
    """Inputs no fleet can serve (a model that fits on no tensor-parallel group, a speed no
    GPU reaches); the message says which and by how much."""


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


def kv_bytes_per_token(model: ModelSpec) -> int:
    """2 (key and value) × layers × KV heads × head dimension × bytes per element."""
    shape = model.shape
    size = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * model.kv_bytes_per_element
    return math.ceil(size)


def weights_bytes(model: ModelSpec) -> int:
    return math.ceil(model.shape.num_params * model.weight_bytes_per_param)


def free_kv_bytes(fleet: FleetSpec, weights: float, tensor_parallel: int = 1) -> float:
    """What a tensor-parallel group leaves for the KV cache: usable memory less the weights."""
    return tensor_parallel * fleet.usable_memory_fraction * fleet.gpu.memory_bytes - weights


def streams_that_fit(free_bytes: float, context_tokens: float, kv_per_token: float) -> int:
    """Whole streams of ``context_tokens`` whose KV cache fits in ``free_bytes``."""
    return max(0, math.floor(_settle(free_bytes / (context_tokens * kv_per_token))))


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

    fit_degree = _tensor_parallel_to_fit(fleet, weights + kv_stream)
    if fleet.tensor_parallel is not None and fleet.tensor_parallel < fit_degree:
        raise PlanError(
            f"--tensor-parallel {fleet.tensor_parallel} is too small: the weights and one "
            f"stream's KV cache need {fit_degree} {gpu.name}"
        )
    throughput, tensor_parallel, how, chosen = _gpu_throughput(
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


def _tensor_parallel_to_fit(fleet: FleetSpec, needed_bytes: float) -> int:
    degree = 1
    while degree <= fleet.max_tensor_parallel:
        if free_kv_bytes(fleet, needed_bytes, degree) >= 0:
            return degree
        degree *= 2
    largest = degree // 2
    raise PlanError(
        f"the model does not fit on any tensor-parallel group of up to "
        f"{fleet.max_tensor_parallel} {fleet.gpu.name}: it needs {_bytes(needed_bytes)} "
        f"(weights and one stream's KV cache), {largest} GPUs hold "
        f"{_bytes(largest * fleet.usable_memory_fraction * fleet.gpu.memory_bytes)} usable"
    )


def _gpu_throughput(
    inputs: PlanInputs, weights: int, kv_token: int, kv_stream: int, fit_degree: int
) -> tuple[GpuThroughput, int, str, str]:
    """The per-GPU rate (given, measured or the roofline's), the tensor-parallel degree it
    runs at, how the rate was found, and why that degree (when it is not ``fit_degree``).

    The roofline tries every degree from ``fit_degree`` to the largest (or only the fleet's
    ``tensor_parallel``, where set). A bigger group leaves more memory for the KV cache and
    shares the weights' reads, but pays all-reduces between its GPUs that the roofline does
    not count; so it takes the smallest degree whose per-GPU rate is at least
    ``GOOD_ENOUGH_TP_RATE`` of the best one's."""
    shape, fleet, gpu = inputs.shape, inputs.fleet, inputs.fleet.gpu
    if inputs.gpu_throughput is not None:
        given = inputs.gpu_throughput
        degree = fleet.tensor_parallel or fit_degree
        return given, degree, f"{given.source}: {_n(given.output_tokens_per_s)}", ""
    load = DecodeLoad(
        weights_bytes=weights,
        num_params=inputs.model.shape.num_params,
        kv_bytes_read_per_stream=shape.mean_decode_context_tokens * kv_token,
    )
    candidates: list[tuple[float, int, DecodeBatch]] = []
    degrees = (
        [fleet.tensor_parallel]
        if fleet.tensor_parallel
        else _powers_of_two(fit_degree, fleet.max_tensor_parallel)
    )
    for degree in degrees:
        hardware = DecodeHardware(
            bandwidth_bytes_per_s=degree * gpu.bandwidth_bytes_per_s,
            flops_per_s=degree * gpu.flops_per_s,
        )
        max_streams = streams_that_fit(free_kv_bytes(fleet, weights, degree), 1, kv_stream)
        batch = largest_batch(
            load, hardware, stream_tokens_per_s=shape.stream_tokens_per_s, max_streams=max_streams
        )
        if batch is not None:
            candidates.append((batch.tokens_per_s / degree, degree, batch))
    if not candidates:
        batch_one_s = weights / (degrees[-1] * gpu.bandwidth_bytes_per_s)
        raise PlanError(
            f"no GPU group of up to {degrees[-1]} {gpu.name} gives a stream "
            f"{_n(shape.stream_tokens_per_s)} tokens/s: reading the weights alone takes "
            f"{batch_one_s * 1000:,.2f} ms a step, and a step may take at most "
            f"{1000 / shape.stream_tokens_per_s:,.2f} ms"
        )
    best_rate = max(rate for rate, _, _ in candidates)
    rate, degree, batch = next(c for c in candidates if c[0] >= GOOD_ENOUGH_TP_RATE * best_rate)
    how = (
        f"roofline on {degree} GPU(s): step = max(({_bytes(weights)} + B × "
        f"{_n(shape.mean_decode_context_tokens)} tokens × {_bytes(kv_token)}) / "
        f"{_n(degree * gpu.bandwidth_bytes_per_s)} B/s, 2 × {_n(load.num_params)} × B / "
        f"{_n(degree * gpu.flops_per_s)} FLOP/s); B = {batch.batch_size} (limited by "
        f"{batch.limited_by}), step {batch.step_seconds * 1000:,.2f} ms; {batch.batch_size} / "
        f"{batch.step_seconds * 1000:,.2f} ms / {degree} = {_n(rate)}"
    )
    chosen = ""
    if len(candidates) > 1:
        tried = ", ".join(f"{d} → {_n(round(r, 1))}" for r, d, _ in candidates)
        chosen = (
            f"; the roofline's rates per GPU by degree: {tried} tokens/s; the smallest degree "
            f"with at least {GOOD_ENOUGH_TP_RATE:.0%} of the best: {degree}"
        )
    throughput = GpuThroughput(rate, batch.stream_tokens_per_s, source="roofline")
    return throughput, degree, how, chosen


def _powers_of_two(low: int, high: int) -> list[int]:
    degrees = [low]
    while degrees[-1] * 2 <= high:
        degrees.append(degrees[-1] * 2)
    return degrees


def _settle(value: float) -> float:
    """``value`` with floating-point noise removed, so a ratio that is whole stays whole."""
    return round(value, 9)


def _whole_groups(gpus: float, group: int) -> int:
    """At least ``gpus`` GPUs, in whole tensor-parallel groups."""
    return math.ceil(_settle(gpus / group)) * group
