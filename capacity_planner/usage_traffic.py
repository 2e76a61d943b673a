"""Traffic and request shape from the gateway's own usage records (``tollway plan
--from-usage``): request rate at its peak, prompt and output length percentiles, and the share
of prompt tokens the prefix cache served, for one tenant or all, over a period.

Only completed requests count: a rejected request never reached an engine, and a cancelled or
failed one stopped short of its real length. The peak is the busiest window (a minute by
default) anywhere in the period, so a burst of a few seconds does not pass for the hour's rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import make_url

from capacity_planner.plan_inputs import RequestShape, RequestTraffic
from gateway.storage.database import Database
from gateway.storage.models import UsageRecord, UsageStatus

PEAK_WINDOW_S = 60
_SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class UsageSample:
    """One completed request's counts, and when it arrived."""

    created_at: datetime
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class UsageTraffic:
    num_requests: int
    period_s: float
    peak_requests_per_s: float
    prompt_tokens_mean: float
    prompt_tokens_p50: float
    prompt_tokens_p90: float
    output_tokens_mean: float
    output_tokens_p50: float
    output_tokens_p90: float
    cached_fraction: float  # cached prompt tokens / prompt tokens

    @property
    def requests_per_day(self) -> float:
        return self.num_requests / self.period_s * _SECONDS_PER_DAY

    def traffic(self) -> RequestTraffic:
        """Requests a day over the period, and the peak window's rate over the mean rate."""
        mean_rate = self.num_requests / self.period_s
        return RequestTraffic(
            requests_per_day=self.requests_per_day,
            peak_factor=max(1.0, self.peak_requests_per_s / mean_rate),
        )

    def request_shape(self, *, stream_tokens_per_s: float, ttft_s: float) -> RequestShape:
        return RequestShape(
            prompt_tokens=self.prompt_tokens_mean,
            output_tokens=self.output_tokens_mean,
            stream_tokens_per_s=stream_tokens_per_s,
            ttft_s=ttft_s,
            prompt_tokens_p90=self.prompt_tokens_p90,
            output_tokens_p90=self.output_tokens_p90,
            cached_fraction=min(self.cached_fraction, 0.99),
        )


def summarize_usage(
    samples: Iterable[UsageSample],
    *,
    start: datetime,
    end: datetime,
    peak_window_s: int = PEAK_WINDOW_S,
) -> UsageTraffic | None:
    """The traffic of ``samples`` over ``[start, end)``; None when there is no sample."""
    if end <= start:
        raise ValueError("the usage period must end after it starts")
    arrivals: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    num_cached = 0
    for sample in samples:
        arrivals.append((sample.created_at - start).total_seconds())
        prompts.append(sample.prompt_tokens)
        outputs.append(sample.completion_tokens)
        num_cached += sample.cached_tokens
    if not prompts:
        return None
    period_s = (end - start).total_seconds()
    num_prompt = sum(prompts)
    return UsageTraffic(
        num_requests=len(prompts),
        period_s=period_s,
        peak_requests_per_s=busiest_window(arrivals, peak_window_s) / min(peak_window_s, period_s),
        prompt_tokens_mean=num_prompt / len(prompts),
        prompt_tokens_p50=percentile(prompts, 50),
        prompt_tokens_p90=percentile(prompts, 90),
        output_tokens_mean=sum(outputs) / len(outputs),
        output_tokens_p50=percentile(outputs, 50),
        output_tokens_p90=percentile(outputs, 90),
        cached_fraction=num_cached / num_prompt if num_prompt else 0.0,
    )


def busiest_window(arrivals: list[float], window_s: float) -> int:
    """The most arrivals in any ``window_s`` seconds (a sliding window over sorted times)."""
    arrivals = sorted(arrivals)
    busiest = first = 0
    for last, arrived in enumerate(arrivals):
        while arrived - arrivals[first] >= window_s:
            first += 1
        busiest = max(busiest, last - first + 1)
    return busiest


def percentile(values: Sequence[float], pct: float) -> float:
    """The nearest-rank percentile: the smallest value with ``pct``% of values at or below it."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return float(ordered[rank - 1])


def read_usage_traffic(
    database_url: str, *, tenant_id: str | None, period: timedelta, end: datetime
) -> UsageTraffic | None:
    """The completed requests of ``tenant_id`` (None: every tenant) in ``[end - period, end)``."""
    url = make_url(database_url)  # an ArgumentError names a malformed URL
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        raise ValueError(f"no SQLite database at {url.database}")  # rather than create one
    start = end - period
    query = select(
        UsageRecord.created_at,
        UsageRecord.prompt_tokens,
        UsageRecord.completion_tokens,
        UsageRecord.cached_tokens,
    ).where(
        UsageRecord.status == UsageStatus.COMPLETED,
        UsageRecord.created_at >= start,
        UsageRecord.created_at < end,
    )
    if tenant_id is not None:
        query = query.where(UsageRecord.tenant_id == tenant_id)
    database = Database(database_url)
    try:
        with database.session() as session:
            rows = session.execute(query.execution_options(yield_per=10_000))
            return summarize_usage((UsageSample(*row) for row in rows), start=start, end=end)
    finally:
        database.dispose()
