"""The loop histogram reads exactly as prometheus_client's own Histogram, fed the same values."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.observability.loop_histogram import LoopHistogram

BUCKETS = (0.001, 0.0025, 0.01, 0.5, 1.0, 10.0)


def series_lines(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without ``_created`` (which only the reference has)."""
    text = generate_latest(registry).decode()
    return sorted(
        line for line in text.splitlines() if line and "_created" not in line.split("{")[0]
    )


def test_buckets_sum_and_count_match_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("t_seconds", "Doc.", ("model",), buckets=BUCKETS, registry=ours)
    reference = Histogram("t_seconds", "Doc.", ("model",), buckets=BUCKETS, registry=theirs)
    rng = random.Random(0)
    values = [0.0, 0.001, 0.0025, 10.0, 11.0, *(rng.expovariate(10) for _ in range(500))]
    for i, value in enumerate(values):  # bucket edges included: "le" means value <= bound
        model = ("small", "large")[i % 2]
        loop.labels(model).observe(value)
        reference.labels(model).observe(value)
    assert series_lines(ours) == series_lines(theirs)


def test_an_unobserved_histogram_exposes_only_its_help_and_type() -> None:
    registry = CollectorRegistry()
    LoopHistogram("t_seconds", "Doc.", ("model",), buckets=BUCKETS, registry=registry)
    assert series_lines(registry) == ["# HELP t_seconds Doc.", "# TYPE t_seconds histogram"]


def test_bad_buckets_and_label_counts_are_refused() -> None:
    registry = CollectorRegistry()
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("a", "Doc.", (), buckets=(1.0, 0.5), registry=registry)
    histogram = LoopHistogram("b", "Doc.", ("model",), buckets=(1.0,), registry=registry)
    with pytest.raises(ValueError, match="label"):
        histogram.labels("x", "y")
