"""The fleet's GPUs: whole tensor-parallel groups, headroom on top, and a forced degree too
small for the model refused by name."""

from __future__ import annotations

import pytest

from capacity_planner.fleet_size import fleet_size
from capacity_planner.gpu_presets import gpu_preset
from capacity_planner.kv_memory import model_memory
from capacity_planner.peak_traffic import peak_traffic
from capacity_planner.plan_inputs import (
    FleetSpec,
    GpuThroughput,
    ModelSpec,
    PlanError,
    PlanInputs,
    RequestShape,
    UserTraffic,
)
from tests.capacity_planner.article_models import LLAMA_8B, LLAMA_70B

H100 = gpu_preset("h100-80gb")


def inputs(chat_model: ModelSpec, fleet: FleetSpec) -> PlanInputs:
    """Article 1's chat product: 500,000 output tokens/s at the peak, 2,500 a GPU."""
    return PlanInputs(
        traffic=UserTraffic(1_000_000, 0.05, 1 / 3),
        shape=RequestShape(2500, 500, stream_tokens_per_s=30, ttft_s=2.0),
        model=chat_model,
        fleet=fleet,
        gpu_throughput=GpuThroughput(2500, 30, source="given"),
    )


def test_gpus_come_in_whole_groups_with_headroom() -> None:
    plan = inputs(LLAMA_8B, FleetSpec(H100, headroom_fraction=0.3, tensor_parallel=8))
    memory = model_memory(plan.model, plan.shape)
    fleet = fleet_size(plan, memory, peak_traffic(plan.traffic, plan.shape))
    assert fleet.tensor_parallel == 8
    assert fleet.gpus_at_peak == 200  # 500,000 / 2,500: 25 groups of 8
    assert fleet.gpus_with_headroom == 264  # 260, up to 33 groups of 8
    assert fleet.streams_per_gpu == pytest.approx(2500 / 30)


def test_a_forced_degree_too_small_for_the_model_is_refused() -> None:
    plan = inputs(LLAMA_70B, FleetSpec(H100, tensor_parallel=1))
    memory = model_memory(plan.model, plan.shape)
    with pytest.raises(PlanError, match=r"--tensor-parallel 1 is too small: .* need 2 h100-80gb"):
        fleet_size(plan, memory, peak_traffic(plan.traffic, plan.shape))
