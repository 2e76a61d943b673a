"""What the Fleet page shows, gathered from what the gateway already knows: its replica set
(ready, ejected), each replica's last ``load`` line from its ``/kv_events`` stream (queue
depth, KV use), its own Prometheus metrics (TTFT, outcomes, cached input) and the live
rollout table. Nothing here asks an engine anything: the page costs no network round trip.

A replica whose ``/ready`` answers 503 is loading weights or draining; the gateway cannot
tell which, so the page says "not ready". TTFT quantiles are read from the histogram's
buckets as Prometheus' ``histogram_quantile`` does (linear within the bucket).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gateway.rollouts import RolloutTable
from gateway.upstream.prefix_index import PrefixIndex
from gateway.upstream.replica_set import ReplicaSet

TTFT_METRIC = "tollway_gateway_time_to_first_token_seconds"
REQUESTS_METRIC = "tollway_gateway_requests"
TOKENS_METRIC = "tollway_gateway_tokens"


@dataclass(frozen=True)
class ReplicaView:
    base: str
    state: str  # "ready", "not ready" (loading or draining), "ejected"
    num_waiting: int | None  # None: no load line yet
    num_running: int | None
    kv_usage: float | None


@dataclass(frozen=True)
class ModelView:
    name: str
    replicas: list[ReplicaView]
    ttft_p50_s: float | None  # None: no request measured yet
    ttft_p90_s: float | None
    num_requests: int
    error_rate: float | None
    cache_hit_rate: float | None  # cached input over all input


@dataclass(frozen=True)
class RolloutView:
    name: str
    weights: list[tuple[str, int, float]]  # version, weight, share


@dataclass(frozen=True)
class FleetView:
    models: list[ModelView]
    rollouts: list[RolloutView]


def fleet_view(
    models: Iterable[str],
    replica_set: ReplicaSet,
    index: PrefixIndex,
    registry: CollectorRegistry,
    rollouts: RolloutTable,
    now: float | None = None,
) -> FleetView:
    now = time.monotonic() if now is None else now
    followed = set(index)
    measured = _measured(registry)
    views = []
    for name in models:
        replicas = []
        for base in replica_set.members(name):
            health = replica_set.health(base)
            state = (
                "ejected" if health.is_ejected(now) else "ready" if health.is_ready else "not ready"
            )
            load = index.replica(base).load if base in followed else None
            replicas.append(
                ReplicaView(
                    base,
                    state,
                    None if load is None else load.num_waiting,
                    None if load is None else load.num_running,
                    None if load is None else load.kv_usage,
                )
            )
        views.append(_model_view(name, replicas, measured))
    rollout_views = [
        RolloutView(name, _shares(rollout.weights)) for name, rollout in sorted(rollouts.items())
    ]
    return FleetView(views, rollout_views)


@dataclass
class _Measured:
    ttft_buckets: dict[str, dict[float, float]]  # model -> le -> cumulative count
    outcomes: dict[str, dict[str, float]]  # model -> status -> count
    tokens: dict[str, dict[str, float]]  # model -> direction -> count


def _measured(registry: CollectorRegistry) -> _Measured:
    ttft: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    outcomes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tokens: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in registry.collect():
        for sample in family.samples:
            labels = sample.labels
            if family.name == TTFT_METRIC and sample.name.endswith("_bucket"):
                ttft[labels["model"]][float(labels["le"])] += sample.value
            elif family.name == REQUESTS_METRIC and sample.name.endswith("_total"):
                outcomes[labels["model"]][labels["status"]] += sample.value
            elif family.name == TOKENS_METRIC and sample.name.endswith("_total"):
                tokens[labels["model"]][labels["direction"]] += sample.value
    return _Measured(ttft, outcomes, tokens)


def _model_view(name: str, replicas: list[ReplicaView], measured: _Measured) -> ModelView:
    buckets = sorted(measured.ttft_buckets.get(name, {}).items())
    outcomes = measured.outcomes.get(name, {})
    num_requests = int(sum(outcomes.values()))
    num_errors = sum(
        count
        for status, count in outcomes.items()
        if status == "upstream_error" or status.startswith("rejected:5")
    )
    tokens = measured.tokens.get(name, {})
    num_input = tokens.get("input", 0.0) + tokens.get("cached_input", 0.0)
    return ModelView(
        name=name,
        replicas=replicas,
        ttft_p50_s=histogram_quantile(0.5, buckets),
        ttft_p90_s=histogram_quantile(0.9, buckets),
        num_requests=num_requests,
        error_rate=num_errors / num_requests if num_requests else None,
        cache_hit_rate=tokens.get("cached_input", 0.0) / num_input if num_input else None,
    )


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(le, count)`` buckets (the last ``+Inf``), linear
    within the bucket it falls in; None with no observation. One in the ``+Inf`` bucket is
    reported as the largest finite bound, as Prometheus does."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _shares(weights: Mapping[str, int]) -> list[tuple[str, int, float]]:
    total = sum(weights.values())
    return [(version, weight, weight / total) for version, weight in weights.items()]
