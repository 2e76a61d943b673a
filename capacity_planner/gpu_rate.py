"""The per-GPU output rate and the tensor-parallel group it runs in: given, measured, or the
decode roofline's best over the groups the model fits on."""

from __future__ import annotations

from capacity_planner.kv_memory import free_kv_bytes, streams_that_fit
from capacity_planner.plan_inputs import FleetSpec, GpuThroughput, PlanError, PlanInputs
from capacity_planner.quantity_text import bytes_text as _bytes
from capacity_planner.quantity_text import number_text as _n
from capacity_planner.roofline import DecodeBatch, DecodeHardware, DecodeLoad, largest_batch

# A larger tensor-parallel group must at least reach this share of the best per-GPU rate.
GOOD_ENOUGH_TP_RATE = 0.5


def tensor_parallel_to_fit(fleet: FleetSpec, needed_bytes: float) -> int:
    """The smallest power of 2 of GPUs whose usable memory holds ``needed_bytes``."""
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


def gpu_rate(
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
