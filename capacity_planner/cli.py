"""The ``tollway plan`` command: how many GPUs for this traffic, and what they cost.

A thin shell: `capacity_planner.options` turns the options into `PlanInputs` (reading a
checkpoint's shape, the gateway's usage records or a measured engine where asked), the pure
`plan_capacity` plans, and `capacity_planner.report` prints the steps. Any bad input is
one line on stderr and exit code 1 (2 for options that do not go together). The planning
modules are imported when the command runs, so ``tollway --help`` does not load them.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from capacity_planner.gpu_presets import GPU_PRESETS
from capacity_planner.numeric_formats import BYTES_PER_ELEMENT

TRAFFIC, SHAPE, MODEL, GPU, FLEET, MEASURE = (
    "Traffic",
    "Request shape",
    "Model",
    "GPU",
    "Fleet and cost",
    "Measure an engine",
)


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


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
    options = dict(locals())  # the options by name, before anything else is defined here
    from capacity_planner.capacity_plan import plan_capacity
    from capacity_planner.engine_measurement import MeasurementError
    from capacity_planner.options import UsageError, plan_inputs
    from capacity_planner.report import print_plan_json, print_plan_table

    try:
        inputs, usage, measurement = plan_inputs(options)
        result = plan_capacity(inputs)
    except UsageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    except (ValueError, OSError, ArithmeticError, MeasurementError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if output_format is OutputFormat.json:
        print_plan_json(result, inputs, usage, measurement)
    else:
        print_plan_table(result, inputs, usage, measurement)


# `tollway plan ...` (handed over by the gateway's CLI, gateway.launcher.handed_over_commands).
app = typer.Typer(name="plan", add_completion=False)
app.command()(plan)
