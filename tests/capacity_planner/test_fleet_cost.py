"""The fleet's cost: per million output tokens at the average utilization, per month for every
GPU (headroom included), and none where a GPU-hour has no price."""

from __future__ import annotations

import pytest

from capacity_planner.fleet_cost import HOURS_PER_MONTH, fleet_cost
from capacity_planner.fleet_size import FleetSize
from capacity_planner.gpu_presets import gpu_preset
from capacity_planner.plan_inputs import FleetSpec, GpuThroughput

H100 = gpu_preset("h100-80gb")
# 200 GPUs at 2,000 output tokens/s each, 280 with 40% headroom.
FLEET = FleetSize(
    tensor_parallel=1,
    gpu_throughput=GpuThroughput(2000, 30, source="given"),
    streams_per_gpu=2000 / 30,
    gpus_at_peak=200,
    gpus_with_headroom=280,
    steps=(),
)


def test_the_cost_per_million_tokens_and_per_month() -> None:
    cost = fleet_cost(FleetSpec(H100, dollars_per_gpu_hour=3, average_utilization=0.5), FLEET)
    # $3 / (2,000 tokens/s × 3,600 s × 0.5) × 10^6
    assert cost.cost_per_million_output_tokens == pytest.approx(3 / 3.6e6 * 1e6)
    assert cost.cost_per_month == 280 * 3 * HOURS_PER_MONTH
    assert [step.key for step in cost.steps] == ["cost_per_million_output_tokens", "cost_per_month"]


def test_no_price_no_cost() -> None:
    cost = fleet_cost(FleetSpec(H100), FLEET)
    assert (cost.cost_per_million_output_tokens, cost.cost_per_month) == (None, None)
    assert cost.steps == ()
