"""What the fleet costs, where a GPU-hour has a price: per million output tokens (a GPU sells
its rate at the average utilization) and per month (every GPU, headroom included)."""

from __future__ import annotations

from dataclasses import dataclass

from capacity_planner.fleet_size import FleetSize
from capacity_planner.plan_inputs import FleetSpec
from capacity_planner.plan_step import PlanStep
from capacity_planner.quantity_text import number_text as _n

HOURS_PER_MONTH = 730  # 8,760 hours a year / 12


@dataclass(frozen=True)
class FleetCost:
    cost_per_million_output_tokens: float | None  # None: no price per GPU-hour given
    cost_per_month: float | None
    steps: tuple[PlanStep, ...]


def fleet_cost(fleet: FleetSpec, size: FleetSize) -> FleetCost:
    dollars = fleet.dollars_per_gpu_hour
    if dollars is None:
        return FleetCost(None, None, ())
    rate = size.gpu_throughput.output_tokens_per_s
    tokens_per_hour = rate * 3600 * fleet.average_utilization
    cost_per_million = dollars / tokens_per_hour * 1e6
    cost_per_month = size.gpus_with_headroom * dollars * HOURS_PER_MONTH
    steps = (
        PlanStep(
            "cost_per_million_output_tokens",
            "Cost per million output tokens",
            f"${_n(dollars)}/h / ({_n(rate)} tokens/s × 3,600 s × "
            f"{_n(fleet.average_utilization)} utilization) × 10^6 = ${cost_per_million:,.2f}",
        ),
        PlanStep(
            "cost_per_month",
            "Cost per month",
            f"{size.gpus_with_headroom} GPUs × ${_n(dollars)}/h × {HOURS_PER_MONTH} h = "
            f"${cost_per_month:,.0f}",
        ),
    )
    return FleetCost(cost_per_million, cost_per_month, steps)
