"""``tollway plan``'s options, turned into `PlanInputs`: which traffic, model and GPU were
given, a checkpoint's shape, the gateway's usage records and a measured engine where asked.

`UsageError` is for options that do not go together (exit code 2); a `ValueError`,
`OSError` or `MeasurementError` is for a value that is wrong (exit code 1).
"""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timedelta, timezone
from typing import Any

from capacity_planner.engine_measurement import LoadSpec, Measurement, measure_engine
from capacity_planner.gpu_presets import GB, GPU_PRESETS, TFLOPS, GpuSpec, gpu_preset
from capacity_planner.model_shape import ModelShape, shape_from_checkpoint
from capacity_planner.numeric_formats import bytes_per_element
from capacity_planner.plan_inputs import (
    FleetSpec,
    GpuThroughput,
    ModelSpec,
    PlanInputs,
    RequestShape,
    RequestTraffic,
    Traffic,
    UserTraffic,
)
from capacity_planner.usage_traffic import UsageTraffic, read_usage_traffic

_SHAPE_OPTIONS = (
    "prompt_tokens",
    "prompt_tokens_p90",
    "output_tokens",
    "output_tokens_p90",
    "cached_fraction",
)


class UsageError(ValueError):
    """Options that do not go together."""


def plan_inputs(o: dict[str, Any]) -> tuple[PlanInputs, UsageTraffic | None, Measurement | None]:
    model = _model(o)
    fleet = FleetSpec(
        gpu=_gpu(o),
        usable_memory_fraction=o["usable_memory_fraction"],
        headroom_fraction=o["headroom_fraction"],
        dollars_per_gpu_hour=o["dollars_per_gpu_hour"],
        average_utilization=o["average_utilization"],
        max_tensor_parallel=o["max_tensor_parallel"],
        # A measured engine on several GPUs is one tensor-parallel group of them.
        tensor_parallel=o["tensor_parallel"]
        or (
            o["measure_num_gpus"]
            if o["measure"] is not None and o["measure_num_gpus"] > 1
            else None
        ),
    )
    traffic, shape, usage = _traffic_and_shape(o)
    measurement = None
    throughput = None
    if o["measure"] is not None and o["gpu_tokens_per_second"] is not None:
        raise UsageError("give --measure or --gpu-tokens-per-second, not both")
    if o["gpu_tokens_per_second"] is not None:
        throughput = GpuThroughput(
            o["gpu_tokens_per_second"], shape.stream_tokens_per_s, source="given"
        )
    elif o["measure"] is not None:
        if o["measure_num_gpus"] < 1:
            raise ValueError(f"--measure-num-gpus must be at least 1, got {o['measure_num_gpus']}")
        spec = LoadSpec(
            base_url=o["measure"],
            prompt_tokens=round(shape.prompt_tokens),
            output_tokens=round(shape.output_tokens),
            stream_tokens_per_s=shape.stream_tokens_per_s,
            max_concurrency=o["measure_max_concurrency"],
            model=o["measure_model"],
            api_key=o["measure_api_key"],
        )
        measurement = asyncio.run(measure_engine(spec))
        throughput = measurement.gpu_throughput(o["measure_num_gpus"])
    return PlanInputs(traffic, shape, model, fleet, throughput), usage, measurement


def _traffic_and_shape(o: dict[str, Any]) -> tuple[Traffic, RequestShape, UsageTraffic | None]:
    users = ("daily_users", "peak_active_fraction", "in_flight_fraction")
    requests = ("requests_per_day", "peak_factor")
    given = [
        name
        for name, group in (("users", users), ("requests", requests), ("usage", ("from_usage",)))
        if any(o[option] is not None for option in group)
    ]
    if len(given) != 1:
        raise UsageError(
            "give one kind of traffic: --daily-users, --peak-active-fraction and "
            "--in-flight-fraction; or --requests-per-day and --peak-factor; or --from-usage"
        )
    if given == ["usage"]:
        return _from_usage(o)
    group = users if given == ["users"] else requests
    _require(o, group)
    traffic: Traffic = (
        UserTraffic(*(o[name] for name in users))
        if given == ["users"]
        else RequestTraffic(*(o[name] for name in requests))
    )
    _require(o, ("prompt_tokens", "output_tokens"))
    shape = RequestShape(
        prompt_tokens=o["prompt_tokens"],
        output_tokens=o["output_tokens"],
        stream_tokens_per_s=o["stream_tokens_per_s"],
        ttft_s=o["ttft_s"],
        prompt_tokens_p90=o["prompt_tokens_p90"],
        output_tokens_p90=o["output_tokens_p90"],
        cached_fraction=o["cached_fraction"] or 0.0,
    )
    return traffic, shape, None


def _from_usage(o: dict[str, Any]) -> tuple[Traffic, RequestShape, UsageTraffic]:
    taken = [f"--{name.replace('_', '-')}" for name in _SHAPE_OPTIONS if o[name] is not None]
    if taken:
        raise UsageError(f"--from-usage reads the request shape; drop {', '.join(taken)}")
    if not o["usage_days"] > 0:
        raise ValueError(f"--usage-days must be greater than 0, got {o['usage_days']}")
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    try:
        usage = read_usage_traffic(
            o["from_usage"],
            tenant_id=o["tenant"],
            period=timedelta(days=o["usage_days"]),
            end=datetime.now(timezone.utc),
        )
    except (SQLAlchemyError, ArgumentError) as exc:
        first_line = str(exc).strip().splitlines()[0]  # SQLAlchemy appends the SQL and a link
        raise ValueError(f"reading usage records failed: {first_line}") from None
    if usage is None:
        whose = f"tenant {o['tenant']!r}" if o["tenant"] else "any tenant"
        raise ValueError(
            f"no completed request of {whose} in the last {o['usage_days']:g} days to plan from"
        )
    shape = usage.request_shape(stream_tokens_per_s=o["stream_tokens_per_s"], ttft_s=o["ttft_s"])
    return usage.traffic(), shape, usage


def _model(o: dict[str, Any]) -> ModelSpec:
    by_hand = ("layers", "kv_heads", "head_dim", "params")
    if o["model"] is not None:
        if any(o[name] is not None for name in by_hand):
            raise UsageError("give --model or --layers/--kv-heads/--head-dim/--params, not both")
        shape = shape_from_checkpoint(o["model"])
    else:
        if all(o[name] is None for name in by_hand):
            raise UsageError("give --model PATH, or --layers, --kv-heads, --head-dim and --params")
        _require(o, by_hand)
        if not math.isfinite(o["params"]):
            raise ValueError(f"--params must be a finite number, got {o['params']}")
        shape = ModelShape(
            num_layers=o["layers"],
            num_kv_heads=o["kv_heads"],
            head_dim=o["head_dim"],
            num_params=int(o["params"]),
            source="given",
        )
    if o["weight_quantization"] is None and shape.stored is not None:
        # A GGUF file is served as it stores its weights (its quantization, detected).
        weight_bytes_per_param = shape.stored.num_bytes / shape.num_params
        weight_format = shape.stored.describe(shape.num_params)
    else:
        weight_format = o["weight_quantization"] or o["dtype"]
        weight_bytes_per_param = bytes_per_element(weight_format)
    return ModelSpec(
        shape=shape,
        weight_bytes_per_param=weight_bytes_per_param,
        weight_format=weight_format,
        kv_bytes_per_element=bytes_per_element(o["kv_cache_dtype"] or o["dtype"]),
    )


def _gpu(o: dict[str, Any]) -> GpuSpec:
    custom = ("gpu_memory_gb", "gpu_bandwidth_gb_s", "gpu_tflops")
    if o["gpu"] is not None:
        if any(o[name] is not None for name in custom):
            raise UsageError("give --gpu PRESET or the GPU's figures, not both")
        return gpu_preset(o["gpu"])
    if all(o[name] is None for name in custom):
        raise UsageError(
            f"give --gpu ({', '.join(GPU_PRESETS)}), or --gpu-memory-gb, --gpu-bandwidth-gb-s "
            "and --gpu-tflops"
        )
    _require(o, custom)
    for name in custom:
        if not (o[name] > 0 and math.isfinite(o[name])):
            raise ValueError(
                f"--{name.replace('_', '-')} must be a finite number above 0, got {o[name]}"
            )
    return GpuSpec(
        "custom",
        memory_bytes=o["gpu_memory_gb"] * GB,
        bandwidth_bytes_per_s=o["gpu_bandwidth_gb_s"] * GB,
        flops_per_s=o["gpu_tflops"] * TFLOPS,
        source="given",
    )


def _require(o: dict[str, Any], names: tuple[str, ...]) -> None:
    missing = [f"--{name.replace('_', '-')}" for name in names if o[name] is None]
    if missing:
        raise UsageError(f"missing {', '.join(missing)}")
