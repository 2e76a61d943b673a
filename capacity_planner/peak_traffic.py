"""Traffic at the peak: requests per second, concurrent streams and output tokens per second.

From users, the streams come first (daily users × active at peak × in flight) and Little's
law gives the requests; from requests a day, the other way round. A stream lasts
``output_tokens / stream_tokens_per_s`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from capacity_planner.plan_inputs import RequestShape, Traffic, UserTraffic
from capacity_planner.plan_step import PlanStep
from capacity_planner.quantity_text import number_text as _n

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class PeakTraffic:
    peak_requests_per_s: float
    peak_streams: float
    peak_output_tokens_per_s: float
    steps: tuple[PlanStep, ...]


def peak_traffic(traffic: Traffic, shape: RequestShape) -> PeakTraffic:
    stream_seconds = shape.output_tokens / shape.stream_tokens_per_s
    if isinstance(traffic, UserTraffic):
        peak_streams = (
            traffic.daily_users * traffic.peak_active_fraction * traffic.in_flight_fraction
        )
        peak_requests = peak_streams / stream_seconds
        steps = (
            PlanStep(
                "peak_streams",
                "Peak concurrent streams",
                f"{_n(traffic.daily_users)} daily users × {_n(traffic.peak_active_fraction)} "
                f"active at peak × {_n(traffic.in_flight_fraction)} in flight = "
                f"{_n(peak_streams)}",
            ),
            PlanStep(
                "peak_requests_per_s",
                "Peak requests per second",
                f"{_n(peak_streams)} streams / ({_n(shape.output_tokens)} output tokens / "
                f"{_n(shape.stream_tokens_per_s)} tokens/s) = {_n(peak_requests)}/s",
            ),
        )
    else:
        peak_requests = traffic.requests_per_day / SECONDS_PER_DAY * traffic.peak_factor
        peak_streams = peak_requests * stream_seconds
        steps = (
            PlanStep(
                "peak_requests_per_s",
                "Peak requests per second",
                f"{_n(traffic.requests_per_day)} requests/day / 86,400 s × "
                f"{_n(traffic.peak_factor)} peak factor = {_n(peak_requests)}/s",
            ),
            PlanStep(
                "peak_streams",
                "Peak concurrent streams",
                f"{_n(peak_requests)}/s × {_n(shape.output_tokens)} output tokens / "
                f"{_n(shape.stream_tokens_per_s)} tokens/s = {_n(peak_streams)}",
            ),
        )
    peak_output = peak_streams * shape.stream_tokens_per_s
    output_step = PlanStep(
        "peak_output_tokens_per_s",
        "Peak output tokens/s",
        f"{_n(peak_streams)} streams × {_n(shape.stream_tokens_per_s)} tokens/s = "
        f"{_n(peak_output)}",
    )
    return PeakTraffic(peak_requests, peak_streams, peak_output, (*steps, output_step))
