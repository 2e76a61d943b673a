from __future__ import annotations

import math

from engine_protocol.kv_events import LoadLine
from gateway.console.fleet_view import fleet_view, histogram_quantile
from gateway.observability.metrics import GatewayMetrics
from gateway.rollouts import parse_rollouts
from gateway.upstream.prefix_index import PrefixIndex
from gateway.upstream.replica_set import ReplicaSet


def test_quantiles_interpolate_within_the_bucket() -> None:
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.5, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(0.5, buckets) == 0.2
    assert abs((histogram_quantile(0.75, buckets) or 0) - 0.35) < 1e-9
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.9, [(0.1, 0.0), (math.inf, 5.0)]) == 0.1  # beyond the last bound


def test_the_view_reads_health_load_metrics_and_rollouts() -> None:
    metrics = GatewayMetrics()
    for seconds in (0.02, 0.02, 0.3, 0.3):
        metrics.child(metrics.time_to_first_token, "large", "large-v1").observe(seconds)
    for status, count in (("completed", 8), ("upstream_error", 1), ("rejected:429", 1)):
        for _ in range(count):
            metrics.child(metrics.requests, "chat", "large", "large-v1", status).inc()
    metrics.child(metrics.tokens, "large", "large-v1", "input").inc(300)
    metrics.child(metrics.tokens, "large", "large-v1", "cached_input").inc(100)
    replicas = ReplicaSet({"large": ["http://a", "http://b"]}, metrics=metrics)
    replicas.health("http://b").is_ready = False  # its /ready said 503: loading or draining
    index = PrefixIndex()
    index.replica("http://a").load = LoadLine(3, 2, 25, 100)
    rollouts = parse_rollouts({"large": {"large-v1": 3, "large-v2": 1}})
    view = fleet_view(["large"], replicas, index, metrics.registry, rollouts, now=0.0)
    (model,) = view.models
    assert [(r.base, r.state, r.num_waiting, r.kv_usage) for r in model.replicas] == [
        ("http://a", "ready", 3, 0.25),
        ("http://b", "not ready", None, None),
    ]
    assert model.num_requests == 10
    assert model.error_rate == 0.1
    assert model.cache_hit_rate == 0.25
    assert model.ttft_p50_s is not None
    assert 0.01 < model.ttft_p50_s <= 0.025
    assert model.ttft_p90_s is not None
    assert 0.25 < model.ttft_p90_s <= 0.5
    assert view.rollouts[0].weights == [("large-v1", 3, 0.75), ("large-v2", 1, 0.25)]
