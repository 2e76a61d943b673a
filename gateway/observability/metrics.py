"""Prometheus metrics of one gateway app, on its own registry (several apps share a process).

The request path reaches labelled series through ``GatewayMetrics.child``, which remembers
them: ``prometheus_client``'s ``labels()`` validates its arguments and takes a lock on every
call. Every label value here comes from a bounded set (models, endpoints, outcomes).

``model`` is the public name a request was served under (a model or a rollout, after routing
aliases); ``version`` the model entry that served it (the rollout's version, else the model
itself; empty for a request refused before one was chosen).
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from gateway.observability.loop_histogram import HistogramSeries, LoopHistogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

M = TypeVar("M", bound=MetricWrapperBase)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "tollway_gateway_requests",
            "Completion requests answered, by endpoint, served model, version and outcome.",
            ("endpoint", "model", "version", "status"),
            registry=self.registry,
        )
        self.tokens = Counter(
            "tollway_gateway_tokens",
            "Tokens charged, by served model, version and direction (input, cached_input, output).",
            ("model", "version", "direction"),
            registry=self.registry,
        )
        self.rejections = Counter(
            "tollway_gateway_rejections",
            "Requests refused before reaching an engine, by reason.",
            ("reason",),
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "tollway_gateway_upstream_errors",
            "Failed attempts to reach or read an engine, by model and the version it serves.",
            ("model", "version"),
            registry=self.registry,
        )
        self.time_to_first_token = LoopHistogram(
            "tollway_gateway_time_to_first_token_seconds",
            "Seconds from accepting a request to relaying its first token.",
            ("model", "version"),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = LoopHistogram(
            "tollway_gateway_inter_token_latency_seconds",
            "Seconds between consecutive relayed chunks of a stream.",
            ("model", "version"),
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.uncounted_admissions = Counter(
            "tollway_gateway_uncounted_admissions",
            "Requests admitted without rate limits or budget while Redis was unreachable "
            "(redis_failure_mode: open).",
            registry=self.registry,
        )
        self.healthy_replicas = Gauge(
            "tollway_gateway_healthy_replicas",
            "Engine replicas that may take a request (ready, not ejected), by model.",
            ("model",),
            registry=self.registry,
        )
        self.replica_ejections = Counter(
            "tollway_gateway_replica_ejections",
            "Engine replicas ejected after consecutive failures, by model.",
            ("model",),
            registry=self.registry,
        )
        self.dns_resolution_failures = Counter(
            "tollway_gateway_dns_resolution_failures",
            "Failed resolutions of a dns:// upstream (its last good replicas stay), by upstream.",
            ("upstream",),
            registry=self.registry,
        )
        self.reservations_in_flight = Gauge(
            "tollway_gateway_reservations_in_flight",
            "Budget reservations held by requests in flight on this gateway.",
            registry=self.registry,
        )
        self.usage_records_unaccepted = Counter(
            "tollway_gateway_usage_records_unaccepted",
            "Usage records neither the spill file nor the database took, by kind: an answer "
            "(the request was answered 503 instead) or a refusal (its 4xx went out unrecorded).",
            ("kind",),
            registry=self.registry,
        )

        self.alert_delivery_attempts = Counter(
            "tollway_gateway_alert_delivery_attempts",
            "Budget alert webhook deliveries this gateway attempted, by outcome: delivered "
            "(2xx), refused (another status) or unreachable (no answer in time).",
            ("outcome",),
            registry=self.registry,
        )
        self.alert_events_failed = Counter(
            "tollway_gateway_alert_events_failed",
            "Budget alert events this gateway gave up on after their last attempt (failed).",
            registry=self.registry,
        )
        self.alert_events_pending = Gauge(
            "tollway_gateway_alert_events_pending",
            "Budget alert events waiting in the outbox (shared: every replica reports all of "
            "them), as of this gateway's last delivery pass.",
            registry=self.registry,
        )

        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    @overload
    def child(self, metric: LoopHistogram, *label_values: str) -> HistogramSeries: ...

    @overload
    def child(self, metric: M, *label_values: str) -> M: ...

    def child(self, metric: Any, *label_values: str) -> Any:
        """``metric.labels(*label_values)`` (values in the order the labels were declared)."""
        key = (id(metric), label_values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*label_values)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
