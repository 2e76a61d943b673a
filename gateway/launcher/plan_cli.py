"""The ``tollway plan`` command: how many GPUs for this traffic, and what they cost.

A thin shell: it turns options into `gateway.capacity.plan_inputs` values (reading a
checkpoint's shape, the gateway's usage records or a measured engine where asked), calls the
pure `plan_capacity`, and prints the steps (`gateway.launcher.plan_report`). Any bad input is
one line on stderr and exit code 1 (2 for options that do not go together).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from gateway.capacity.capacity_plan import plan_capacity
from gateway.capacity.engine_measurement import (
    LoadSpec,
    Measurement,
    MeasurementError,
    measure_engine,
)
from gateway.capacity.gpu_presets import GB, GPU_PRESETS, TFLOPS, GpuSpec, gpu_preset
from gateway.capacity.model_shape import ModelShape, shape_from_checkpoint
from gateway.capacity.numeric_formats import BYTES_PER_ELEMENT, bytes_per_element
from gateway.capacity.plan_inputs import (
    FleetSpec,
    GpuThroughput,
    ModelSpec,
    PlanInputs,
    RequestShape,
    RequestTraffic,
    Traffic,
    UserTraffic,
)
from gateway.capacity.usage_traffic import UsageTraffic, read_usage_traffic
from gateway.launcher.plan_report import print_plan_json, print_plan_table

TRAFFIC, SHAPE, MODEL, GPU, FLEET, MEASURE = (
    "Traffic",
    "Request shape",
    "Model",
    "GPU",
    "Fleet and cost",
    "Measure an engine",
)


_SHAPE_OPTIONS = (
    "prompt_tokens",
    "prompt_tokens_p90",
    "output_tokens",
    "output_tokens_p90",
    "cached_fraction",
)


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


class UsageError(ValueError):
    """Options that do not go together (exit code 2)."""


def register_plan_commands(app: typer.Typer) -> None:
    app.command("plan")(plan)


def plan(
    daily_users: Annotated[
        float | None, typer.Option(help="Users a day.", rich_help_panel=TRAFFIC)
    ] = None,
    peak_active_fraction: Annotated[
        float | None,
        typer.Option(help="Share of daily users active in the peak hour.", rich_help_panel=TRAFFIC),
    ] = None,
    in_flight_fraction: Annotated[
        float | None,
        typer.Option(
            help="Share of its time an active user has a response streaming.",
            rich_help_panel=TRAFFIC,
        ),
    ] = None,
    requests_per_day: Annotated[
        float | None, typer.Option(help="Requests a day.", rich_help_panel=TRAFFIC)
    ] = None,
    peak_factor: Annotated[
        float | None,
        typer.Option(help="Peak request rate over the day's mean rate.", rich_help_panel=TRAFFIC),
    ] = None,
    from_usage: Annotated[
        str | None,
        typer.Option(
            help="The gateway's database URL: traffic and request shape from its usage records.",
            rich_help_panel=TRAFFIC,
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(help="With --from-usage: one tenant (default: all).", rich_help_panel=TRAFFIC),
    ] = None,
    usage_days: Annotated[
        float,
        typer.Option(help="With --from-usage: the last N days.", rich_help_panel=TRAFFIC),
    ] = 7.0,
    prompt_tokens: Annotated[
        float | None,
        typer.Option(help="Prompt tokens per request, mean (or p50).", rich_help_panel=SHAPE),
    ] = None,
    prompt_tokens_p90: Annotated[
        float | None, typer.Option(help="Prompt tokens, p90.", rich_help_panel=SHAPE)
    ] = None,
    output_tokens: Annotated[
        float | None,
        typer.Option(help="Output tokens per request, mean (or p50).", rich_help_panel=SHAPE),
    ] = None,
    output_tokens_p90: Annotated[
        float | None, typer.Option(help="Output tokens, p90.", rich_help_panel=SHAPE)
    ] = None,
    stream_tokens_per_s: Annotated[
        float, typer.Option(help="Speed each stream must get, tokens/s.", rich_help_panel=SHAPE)
    ] = 30.0,
    ttft_s: Annotated[
        float, typer.Option(help="Time-to-first-token target, seconds.", rich_help_panel=SHAPE)
    ] = 2.0,
    cached_fraction: Annotated[
        float | None,
        typer.Option(
            help="Share of prompt tokens served from the prefix cache.", rich_help_panel=SHAPE
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(help="A Hugging Face directory or a .gguf file.", rich_help_panel=MODEL),
    ] = None,
    layers: Annotated[int | None, typer.Option(rich_help_panel=MODEL)] = None,
    kv_heads: Annotated[int | None, typer.Option(rich_help_panel=MODEL)] = None,
    head_dim: Annotated[int | None, typer.Option(rich_help_panel=MODEL)] = None,
    params: Annotated[
        float | None, typer.Option(help="Parameter count, e.g. 8e9.", rich_help_panel=MODEL)
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            help=f"The weights' format: {', '.join(BYTES_PER_ELEMENT)}.", rich_help_panel=MODEL
        ),
    ] = "bfloat16",
    weight_quantization: Annotated[
        str | None,
        typer.Option(help="Quantized weights: int8, fp8 or int4.", rich_help_panel=MODEL),
    ] = None,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(help="The KV cache's format (default: --dtype).", rich_help_panel=MODEL),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help=f"A preset: {', '.join(GPU_PRESETS)}.", rich_help_panel=GPU),
    ] = None,
    gpu_memory_gb: Annotated[float | None, typer.Option(rich_help_panel=GPU)] = None,
    gpu_bandwidth_gb_s: Annotated[
        float | None, typer.Option(help="Memory bandwidth, GB/s.", rich_help_panel=GPU)
    ] = None,
    gpu_tflops: Annotated[
        float | None, typer.Option(help="Dense bf16 TFLOP/s.", rich_help_panel=GPU)
    ] = None,
    usable_memory_fraction: Annotated[float, typer.Option(rich_help_panel=FLEET)] = 0.9,
    headroom_fraction: Annotated[
        float, typer.Option(help="Spare GPUs for failures and spikes.", rich_help_panel=FLEET)
    ] = 0.3,
    dollars_per_gpu_hour: Annotated[float | None, typer.Option(rich_help_panel=FLEET)] = None,
    average_utilization: Annotated[
        float,
        typer.Option(help="Share of its capacity a GPU sells, on average.", rich_help_panel=FLEET),
    ] = 1.0,
    max_tensor_parallel: Annotated[int, typer.Option(rich_help_panel=FLEET)] = 8,
    tensor_parallel: Annotated[
        int | None,
        typer.Option(
            help="GPUs per model replica (default: the plan's choice).", rich_help_panel=FLEET
        ),
    ] = None,
    gpu_tokens_per_second: Annotated[
        float | None,
        typer.Option(
            help="Per-GPU output tokens/s at the stream speed, instead of the roofline's.",
            rich_help_panel=FLEET,
        ),
    ] = None,
    measure: Annotated[
        str | None,
        typer.Option(
            help="An engine's base URL: measure its output tokens/s instead of the roofline.",
            rich_help_panel=MEASURE,
        ),
    ] = None,
    measure_model: Annotated[
        str | None, typer.Option(help="Default: the engine's first.", rich_help_panel=MEASURE)
    ] = None,
    measure_api_key: Annotated[
        str | None,
        typer.Option(envvar="TOLLWAY_MEASURE_API_KEY", rich_help_panel=MEASURE),
    ] = None,
    measure_max_concurrency: Annotated[int, typer.Option(rich_help_panel=MEASURE)] = 64,
    measure_num_gpus: Annotated[
        int, typer.Option(help="GPUs the measured engine runs on.", rich_help_panel=MEASURE)
    ] = 1,
    output_format: Annotated[OutputFormat, typer.Option("--format")] = OutputFormat.table,
) -> None:
    """How many GPUs for this traffic, and what they cost: each step with its formula.

    Traffic is --daily-users with --peak-active-fraction and --in-flight-fraction, or
    --requests-per-day with --peak-factor, or --from-usage. The model is --model or --layers,
    --kv-heads, --head-dim and --params; the GPU is --gpu or --gpu-memory-gb,
    --gpu-bandwidth-gb-s and --gpu-tflops. The per-GPU rate is the roofline's unless
    --gpu-tokens-per-second or --measure gives one.
    """
    options = dict(locals())
    try:
        inputs, usage, measurement = _gather(options)
        result = plan_capacity(inputs)
    except UsageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    except (ValueError, OSError, MeasurementError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if output_format is OutputFormat.json:
        print_plan_json(result, inputs, usage, measurement)
    else:
        print_plan_table(result, inputs, usage, measurement)


def _gather(o: dict[str, Any]) -> tuple[PlanInputs, UsageTraffic | None, Measurement | None]:
    model = _model(o)
    fleet = FleetSpec(
        gpu=_gpu(o),
        usable_memory_fraction=o["usable_memory_fraction"],
        headroom_fraction=o["headroom_fraction"],
        dollars_per_gpu_hour=o["dollars_per_gpu_hour"],
        average_utilization=o["average_utilization"],
        max_tensor_parallel=o["max_tensor_parallel"],
        tensor_parallel=o["tensor_parallel"],
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
        raise ValueError(f"reading usage records failed: {exc}") from None
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
        shape = ModelShape(
            num_layers=o["layers"],
            num_kv_heads=o["kv_heads"],
            head_dim=o["head_dim"],
            num_params=int(o["params"]),
            source="given",
        )
    weight_format = o["weight_quantization"] or o["dtype"]
    return ModelSpec(
        shape=shape,
        weight_bytes_per_param=bytes_per_element(weight_format),
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
        if not o[name] > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be greater than 0, got {o[name]}")
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
