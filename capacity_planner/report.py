"""``tollway plan``'s output: a table of steps with their formulas, or one JSON object."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from capacity_planner.capacity_plan import CapacityPlan
from capacity_planner.engine_measurement import Measurement
from capacity_planner.plan_inputs import PlanInputs, UserTraffic
from capacity_planner.quantity_text import bytes_text, number_text
from capacity_planner.usage_traffic import UsageTraffic

_BYTE_KEYS = {"kv_bytes_per_token", "weights_bytes", "kv_bytes_per_stream", "kv_bytes_per_gpu"}


def plan_json(
    plan: CapacityPlan,
    inputs: PlanInputs,
    usage: UsageTraffic | None,
    measurement: Measurement | None,
) -> dict[str, Any]:
    data = plan.to_json_dict()
    gpu = inputs.fleet.gpu
    data["gpu"] = dataclasses.asdict(gpu)
    data["model"] = dataclasses.asdict(inputs.model.shape)
    if usage is not None:
        data["usage"] = {**dataclasses.asdict(usage), "requests_per_day": usage.requests_per_day}
    if measurement is not None:
        data["measurement"] = {
            "model": measurement.model,
            "stream_tokens_per_s": measurement.stream_tokens_per_s,
            "rounds": [
                {
                    "concurrency": r.concurrency,
                    "output_tokens_per_s": r.output_tokens_per_s,
                    # None: every stream's tokens came at once (too fast to time)
                    "slowest_stream_tokens_per_s": _finite(r.slowest_stream_tokens_per_s),
                    "meets_target": r.meets(measurement.stream_tokens_per_s),
                }
                for r in measurement.rounds
            ],
        }
    return data


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def print_plan_json(
    plan: CapacityPlan,
    inputs: PlanInputs,
    usage: UsageTraffic | None,
    measurement: Measurement | None,
) -> None:
    data = plan_json(plan, inputs, usage, measurement)
    print(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False))


def print_plan_table(
    plan: CapacityPlan,
    inputs: PlanInputs,
    usage: UsageTraffic | None,
    measurement: Measurement | None,
) -> None:
    console = Console()
    gpu, shape = inputs.fleet.gpu, inputs.model.shape
    traffic = "users" if isinstance(inputs.traffic, UserTraffic) else "requests"
    if usage is not None:
        traffic = f"usage records ({usage.num_requests:,} requests)"
    console.print(
        f"[bold]tollway plan[/bold]: model {shape.source}, GPU {gpu.name} ({gpu.source}), "
        f"traffic from {traffic}, per-GPU rate from the {plan.gpu_throughput_source}"
    )
    if usage is not None:
        console.print(
            f"usage: peak {usage.peak_requests_per_s:,.3f} requests/s; prompt tokens mean "
            f"{usage.prompt_tokens_mean:,.0f}, p50 {usage.prompt_tokens_p50:,.0f}, p90 "
            f"{usage.prompt_tokens_p90:,.0f}; output tokens mean {usage.output_tokens_mean:,.0f}"
            f", p50 {usage.output_tokens_p50:,.0f}, p90 {usage.output_tokens_p90:,.0f}; cached "
            f"{usage.cached_fraction:.1%} of prompt tokens"
        )
    if measurement is not None:
        rounds = Table("streams", "output tokens/s", "slowest stream tokens/s", "meets target")
        for r in measurement.rounds:
            rounds.add_row(
                str(r.concurrency),
                f"{r.output_tokens_per_s:,.1f}",
                f"{r.slowest_stream_tokens_per_s:,.1f}",
                "yes" if r.meets(measurement.stream_tokens_per_s) else "no",
            )
        console.print(f"measured {measurement.model}:")
        console.print(rounds)
    table = Table("step", "formula", "value", show_lines=True)
    for step in plan.steps:
        table.add_row(step.label, step.formula, _value_text(step.key, getattr(plan, step.key)))
    console.print(table)


def _value_text(key: str, value: object) -> str:
    if key in _BYTE_KEYS and isinstance(value, int | float):
        return bytes_text(value)
    if key == "fits":
        return "fits" if value else "[bold red]does not fit[/bold red]"
    if key == "meets_ttft_target":
        return "meets" if value else "[bold red]misses[/bold red]"
    if key == "prefill_share_per_gpu" and isinstance(value, float):
        return f"{value:.1%}"
    if key.startswith("cost") and isinstance(value, float):
        return f"${value:,.2f}"
    if isinstance(value, float):
        return number_text(round(value, 1))
    return str(value)
