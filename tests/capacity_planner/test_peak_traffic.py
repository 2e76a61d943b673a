"""Traffic at the peak, from users or from requests a day: the two agree by Little's law."""

from __future__ import annotations

import pytest

from capacity_planner.peak_traffic import SECONDS_PER_DAY, peak_traffic
from capacity_planner.plan_inputs import RequestShape, RequestTraffic, UserTraffic

SHAPE = RequestShape(prompt_tokens=2500, output_tokens=500, stream_tokens_per_s=25, ttft_s=2.0)


def test_users_give_streams_then_requests() -> None:
    peak = peak_traffic(UserTraffic(100_000, 0.1, 0.2), SHAPE)
    assert peak.peak_streams == pytest.approx(2000)
    # A stream lasts 500 / 25 = 20 s: 2,000 streams start 100 requests a second.
    assert peak.peak_requests_per_s == pytest.approx(100)
    assert peak.peak_output_tokens_per_s == pytest.approx(2000 * 25)
    keys = [step.key for step in peak.steps]
    assert keys == ["peak_streams", "peak_requests_per_s", "peak_output_tokens_per_s"]


def test_requests_give_the_same_streams_by_littles_law() -> None:
    per_day = 100 / 3 * SECONDS_PER_DAY  # a third of the peak rate on average
    peak = peak_traffic(RequestTraffic(per_day, peak_factor=3), SHAPE)
    assert peak.peak_requests_per_s == pytest.approx(100)
    assert peak.peak_streams == pytest.approx(2000)
    keys = [step.key for step in peak.steps]
    assert keys == ["peak_requests_per_s", "peak_streams", "peak_output_tokens_per_s"]
