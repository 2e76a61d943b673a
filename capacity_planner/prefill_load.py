"""Prefill at the peak: the share of each GPU's FLOP/s the prompts take, and how long a p90
prompt's prefill takes against the TTFT target. Both at the datasheet's peak FLOP/s (about two
FLOPs per parameter per prompt token, cached tokens excepted), so both are lower bounds."""

from __future__ import annotations

from dataclasses import dataclass

from capacity_planner.fleet_size import FleetSize
from capacity_planner.peak_traffic import PeakTraffic
from capacity_planner.plan_inputs import PlanInputs
from capacity_planner.plan_step import PlanStep
from capacity_planner.quantity_text import number_text as _n


@dataclass(frozen=True)
class PrefillLoad:
    peak_prefill_tokens_per_s: float
    prefill_share_per_gpu: float
    prefill_seconds_p90: float
    meets_ttft_target: bool
    steps: tuple[PlanStep, ...]


def prefill_load(inputs: PlanInputs, peak: PeakTraffic, fleet: FleetSize) -> PrefillLoad:
    shape, flops = inputs.shape, inputs.fleet.gpu.flops_per_s
    num_params = inputs.model.shape.num_params
    peak_requests, tensor_parallel = peak.peak_requests_per_s, fleet.tensor_parallel
    prefill_fraction = 1 - shape.cached_fraction
    prefill_tokens = peak_requests * shape.prompt_tokens * prefill_fraction
    prefill_share = 2 * num_params * prefill_tokens / (fleet.gpus_at_peak * flops)
    prompt_p90 = shape.prompt_tokens_p90 or shape.prompt_tokens
    prefill_s = 2 * num_params * prompt_p90 * prefill_fraction / (tensor_parallel * flops)
    meets_ttft = prefill_s <= shape.ttft_s
    steps = (
        PlanStep(
            "prefill_share_per_gpu",
            "Prefill share of each GPU",
            f"2 × {_n(num_params)} params × {_n(peak_requests)}/s × {_n(shape.prompt_tokens)} "
            f"prompt tokens × {_n(prefill_fraction)} uncached / ({fleet.gpus_at_peak} GPUs × "
            f"{_n(flops)} FLOP/s) = {prefill_share:.1%}",
        ),
        PlanStep(
            "meets_ttft_target",
            "Prefill of a p90 prompt",
            f"2 × {_n(num_params)} params × {_n(prompt_p90)} tokens × {_n(prefill_fraction)} / "
            f"({tensor_parallel} × {_n(flops)} FLOP/s) = {prefill_s * 1000:,.1f} ms "
            f"{'≤' if meets_ttft else '>'} TTFT target {shape.ttft_s * 1000:,.0f} ms (before "
            "queueing)",
        ),
    )
    return PrefillLoad(prefill_tokens, prefill_share, prefill_s, meets_ttft, steps)
