"""The articles' worked plans, reproduced by the plan's formulas: the inputs are the article's,
the expected value is what the article prints, and where the article rounds, the test rounds
the same way and says how (the memory arithmetic's own figures: test_kv_memory.py).

Article 1: "How LLM inference works" (the 1-million-user chat example). Article 2: "inference
fundamentals for system design" (configurations A and B, the requests-per-day estimate).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from capacity_planner.capacity_plan import CapacityPlan, plan_capacity
from capacity_planner.gpu_presets import gpu_preset
from capacity_planner.gpu_rate import GOOD_ENOUGH_TP_RATE
from capacity_planner.model_shape import ModelShape
from capacity_planner.peak_traffic import SECONDS_PER_DAY
from capacity_planner.plan_inputs import (
    FleetSpec,
    GpuThroughput,
    ModelSpec,
    PlanError,
    PlanInputs,
    RequestShape,
    RequestTraffic,
    UserTraffic,
)
from tests.capacity_planner.article_models import KIB, LLAMA_8B, LLAMA_70B, model

H100 = gpu_preset("h100-80gb")


# --- the 1-million-user chat example (article 1, "Capacity planning") ----------------------


def million_user_inputs(chat_model: ModelSpec, headroom: float) -> PlanInputs:
    return PlanInputs(
        traffic=UserTraffic(
            daily_users=1_000_000, peak_active_fraction=0.05, in_flight_fraction=1 / 3
        ),
        # "3,000 tokens of context each": 2,500 prompt + 500 output at the end of a stream.
        shape=RequestShape(
            prompt_tokens=2500, output_tokens=500, stream_tokens_per_s=30, ttft_s=2.0
        ),
        model=chat_model,
        fleet=FleetSpec(H100, usable_memory_fraction=1.0, headroom_fraction=headroom),
        gpu_throughput=GpuThroughput(2500, stream_tokens_per_s=30, source="given"),
    )


def test_one_million_users_to_gpus() -> None:
    plan = plan_capacity(million_user_inputs(LLAMA_8B, headroom=0.4))
    # 1. "about 17,000 streams at once" (16,667, rounded to the thousand).
    assert round(plan.peak_streams, -3) == 17_000
    # 2. "That is 500,000 output tokens a second at peak" (exact).
    assert plan.peak_output_tokens_per_s == pytest.approx(500_000)
    # 4. "500,000 / 2,500 = 200 GPUs at peak. Add 30 to 50% headroom ...: about 280."
    assert plan.gpus_at_peak == 200
    assert plan.gpus_with_headroom == 280  # 40%, the middle of 30 to 50%
    assert plan_capacity(million_user_inputs(LLAMA_8B, headroom=0.3)).gpus_with_headroom == 260
    assert plan_capacity(million_user_inputs(LLAMA_8B, headroom=0.5)).gpus_with_headroom == 300
    # 5. "2,500 tokens a second at 30 per stream is 83 streams per GPU" (83.3, whole streams).
    assert math.floor(plan.streams_per_gpu) == 83
    assert plan.tensor_parallel == 1


def test_one_million_users_memory_check() -> None:
    """ "At 3,000 tokens of context each and 128 KB per token, that is 32 GB of KV cache. It fits
    next to an 8B model on an 80 GB GPU. It does not fit next to a 70B model on two.\""""
    small = plan_capacity(million_user_inputs(LLAMA_8B, headroom=0.4))
    assert small.context_tokens == 3000
    # 83.3 × 3,000 × 128 KiB = 32.0 million KiB: the article's "32 GB" (KB = KiB, 1e6 KB = GB).
    assert round(small.kv_bytes_per_gpu / KIB / 1e6) == 32
    assert small.fits
    large = plan_capacity(million_user_inputs(LLAMA_70B, headroom=0.4))
    assert large.tensor_parallel == 2
    assert large.memory_bytes_per_gpu > large.usable_memory_bytes_per_gpu
    assert not large.fits


def test_the_steps_come_in_the_plan_s_order_each_a_field_of_it() -> None:
    inputs = million_user_inputs(LLAMA_8B, headroom=0.4)
    priced = dataclasses.replace(inputs.fleet, dollars_per_gpu_hour=3)
    plan = plan_capacity(dataclasses.replace(inputs, fleet=priced))
    assert [step.key for step in plan.steps] == [
        "kv_bytes_per_token", "weights_bytes", "kv_bytes_per_stream",
        "peak_streams", "peak_requests_per_s", "peak_output_tokens_per_s",
        "tensor_parallel", "gpu_output_tokens_per_s", "streams_per_gpu", "gpus_at_peak",
        "gpus_with_headroom",
        "kv_bytes_per_gpu", "fits",
        "prefill_share_per_gpu", "meets_ttft_target",
        "cost_per_million_output_tokens", "cost_per_month",
    ]  # fmt: skip
    fields = {field.name for field in dataclasses.fields(CapacityPlan)}
    assert {step.key for step in plan.steps} <= fields


# --- the requests-per-day estimate (article 2) ---------------------------------------------


def test_requests_per_day_estimate() -> None:
    """ "1M requests per day is about 12 requests per second on average and perhaps 3x that at
    peak; if each request averages 3,000 input and 500 output tokens, that is 3.5B tokens per
    day, of which the 500M output tokens need sequential decode. If one GPU decodes an
    aggregate of a few thousand tokens per second ..., the output work alone is a handful of
    GPUs at peak.\""""
    traffic = RequestTraffic(requests_per_day=1_000_000, peak_factor=3)
    assert round(traffic.requests_per_day / SECONDS_PER_DAY) == 12  # 11.57
    assert traffic.requests_per_day * (3000 + 500) == 3.5e9
    assert traffic.requests_per_day * 500 == 500e6
    for few_thousand in (2000, 3000, 5000):
        plan = plan_capacity(
            PlanInputs(
                traffic=traffic,
                shape=RequestShape(3000, 500, stream_tokens_per_s=30, ttft_s=2.0),
                model=LLAMA_8B,
                fleet=FleetSpec(H100),
                gpu_throughput=GpuThroughput(few_thousand, 30, source="given"),
            )
        )
        assert plan.peak_requests_per_s == pytest.approx(1e6 / 86_400 * 3)  # 34.7/s
        # Peak output tokens/s = requests/s × output tokens, whatever the stream speed.
        assert plan.peak_output_tokens_per_s == pytest.approx(plan.peak_requests_per_s * 500)
        assert 3 <= plan.gpus_at_peak <= 10  # "a handful": 9, 6 and 4 GPUs


# --- cost (article 1, "The break-even point is simple arithmetic") -------------------------


def test_cost_per_million_output_tokens() -> None:
    """ "Say a GPU costs $3 an hour, and it sustains 2,000 output tokens a second ... about $0.42
    per million. ... At 20% average use, it is $2.08 per million.\""""

    def cost(utilization: float) -> float | None:
        inputs = million_user_inputs(LLAMA_8B, headroom=0.4)
        fleet = FleetSpec(H100, dollars_per_gpu_hour=3, average_utilization=utilization)
        given = GpuThroughput(2000, 30, source="given")
        plan = plan_capacity(PlanInputs(inputs.traffic, inputs.shape, LLAMA_8B, fleet, given))
        return plan.cost_per_million_output_tokens

    assert round(cost(1.0) or 0, 2) == 0.42  # 0.4167, to the cent
    assert round(cost(0.2) or 0, 2) == 2.08  # 2.0833, to the cent


# --- prefill (article 1, "Prefill reads the prompt") ----------------------------------------


def test_prefill_operations_and_time() -> None:
    """ "A 2,000-token prompt on an 8B model is about 32 trillion operations (2 per parameter per
    token). That takes roughly 50 to 100 ms on an H100." The plan's figure is at the datasheet's
    peak FLOP/s, so it is the lower bound below the article's measured range."""
    inputs = million_user_inputs(LLAMA_8B, headroom=0.4)
    shape = RequestShape(2000, 500, stream_tokens_per_s=30, ttft_s=0.1)
    plan = plan_capacity(PlanInputs(inputs.traffic, shape, LLAMA_8B, inputs.fleet))
    assert plan.prefill_seconds_p90 * H100.flops_per_s == pytest.approx(32e12)
    assert 0.02 < plan.prefill_seconds_p90 < 0.05  # 32 ms at peak; 50-100 ms at 32-65% of it
    assert plan.meets_ttft_target
    # Fewer tokens to prefill when the prefix cache serves half of them.
    cached = RequestShape(2000, 500, stream_tokens_per_s=30, ttft_s=0.1, cached_fraction=0.5)
    half = plan_capacity(PlanInputs(inputs.traffic, cached, LLAMA_8B, inputs.fleet))
    assert half.prefill_seconds_p90 == pytest.approx(plan.prefill_seconds_p90 / 2)
    assert half.prefill_share_per_gpu < plan.prefill_share_per_gpu


# --- the tensor-parallel degree ------------------------------------------------------------


def roofline_plan(chat_model: ModelSpec, **fleet: int) -> CapacityPlan:
    inputs = million_user_inputs(chat_model, headroom=0.3)
    return plan_capacity(
        PlanInputs(inputs.traffic, inputs.shape, chat_model, FleetSpec(H100, **fleet))
    )


def test_the_degree_is_the_smallest_within_half_of_the_best_per_gpu_rate() -> None:
    rates = {tp: roofline_plan(LLAMA_70B, tensor_parallel=tp).gpu_output_tokens_per_s
             for tp in (2, 4, 8)}  # fmt: skip
    # On 2 GPUs the weights leave room for 4 streams' KV cache: a few tokens/s per GPU.
    assert rates[2] < GOOD_ENOUGH_TP_RATE * rates[8] <= rates[4] < rates[8]
    chosen = roofline_plan(LLAMA_70B)
    assert chosen.tensor_parallel == 4
    assert chosen.gpu_output_tokens_per_s == rates[4]
    assert chosen.gpus_at_peak % 4 == 0
    # An 8B model on one GPU is already within half of its best rate.
    assert roofline_plan(LLAMA_8B).tensor_parallel == 1
    assert roofline_plan(LLAMA_70B, max_tensor_parallel=2).tensor_parallel == 2


def test_the_roofline_batch_fits_its_kv_cache() -> None:
    for chat_model in (LLAMA_8B, LLAMA_70B):
        plan = roofline_plan(chat_model)
        assert plan.gpu_throughput_source == "roofline"
        assert plan.fits  # its batch stops where the KV cache is full, or sooner
        assert plan.streams_per_gpu * plan.tensor_parallel >= 1


# --- what no fleet can serve ---------------------------------------------------------------


def test_a_model_that_fits_on_no_group_is_refused_by_name() -> None:
    inputs = million_user_inputs(model(126, 8, 405e9), headroom=0.3)
    small_fleet = FleetSpec(gpu_preset("l4"), max_tensor_parallel=8)
    with pytest.raises(PlanError, match=r"does not fit on any tensor-parallel group of up to 8"):
        plan_capacity(PlanInputs(inputs.traffic, inputs.shape, inputs.model, small_fleet))


def test_a_stream_speed_no_gpu_reaches_is_refused() -> None:
    inputs = million_user_inputs(LLAMA_70B, headroom=0.3)
    fast = RequestShape(2500, 500, stream_tokens_per_s=2000, ttft_s=2.0)
    with pytest.raises(PlanError, match=r"gives a stream 2,000 tokens/s"):
        plan_capacity(PlanInputs(inputs.traffic, fast, LLAMA_70B, FleetSpec(H100)))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: UserTraffic(0, 0.05, 0.3), "--daily-users must be greater than 0, got 0"),
        (lambda: UserTraffic(10, 1.5, 0.3), "--peak-active-fraction must be from above 0 to 1"),
        (lambda: RequestTraffic(-5, 3), "--requests-per-day must be greater than 0, got -5"),
        (lambda: RequestShape(100, 0, 30, 1), "--output-tokens must be greater than 0, got 0"),
        (lambda: RequestShape(100, 10, -30, 1), "--stream-tokens-per-s must be greater than 0"),
        (lambda: FleetSpec(H100, usable_memory_fraction=0), "--usable-memory-fraction must be"),
        (lambda: FleetSpec(H100, headroom_fraction=-0.1), "--headroom-fraction must be 0 or"),
        (lambda: GpuThroughput(0, 30, "given"), "--gpu-tokens-per-second must be greater"),
        (lambda: ModelShape(0, 8, 128, 10, "given"), "layers must be greater than 0, got 0"),
        (lambda: gpu_preset("b200"), "unknown GPU preset 'b200'; presets: h100-80gb, h200"),
    ],
)
def test_bad_inputs_are_refused_by_name(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build()  # type: ignore[operator]
