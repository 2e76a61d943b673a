"""Prometheus metrics of one server: engine state read at scrape time, plus request timings.

Speculative decoding's metrics (``tollway_engine_spec_decode_*``, labelled by proposer) appear
only while the engine speculates: a dashboard can tell "off" from "on, nothing accepted".

Each app owns its own ``CollectorRegistry``; nothing is registered globally, so
several apps (and tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from backend_engine.outputs import QUEUE_TIME_BUCKETS, EngineStats, SpeculativeCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineStatsCollector(Collector):
    """Turns one ``EngineStats`` snapshot into gauges and counters on every scrape."""

    def __init__(self, read_stats: Callable[[], EngineStats | None]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        if stats is None:  # no engine yet (it is loading)
            return
        gauges = (
            ("tollway_engine_kv_blocks_used", "KV cache blocks referenced by live requests.",
             stats.num_kv_blocks_used),
            ("tollway_engine_kv_blocks_total", "KV cache blocks in the pool.",
             stats.num_kv_blocks_total),
            ("tollway_engine_requests_waiting", "Requests waiting to be scheduled.",
             stats.num_waiting),
            ("tollway_engine_requests_running", "Requests being generated.", stats.num_running),
        )  # fmt: skip
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = (
            ("tollway_engine_prefix_cache_queries", "Tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("tollway_engine_prefix_cache_hits", "Tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            ("tollway_engine_preemptions", "Requests preempted for lack of KV blocks.",
             stats.num_preemptions),
            ("tollway_engine_prompt_tokens", "Prompt tokens prefilled.", stats.num_prompt_tokens),
            ("tollway_engine_computed_prompt_tokens",
             "Prompt tokens whose KV was computed (not prefix-cache hits, not forked choices).",
             stats.num_computed_prompt_tokens),
            ("tollway_engine_generation_tokens", "Tokens generated.", stats.num_generation_tokens),
        )  # fmt: skip
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        queue_time = HistogramMetricFamily(
            "tollway_engine_queue_time_seconds",
            "Seconds a request waited before it was first scheduled, by priority class.",
            labels=("priority",),
        )
        for priority, times in sorted(stats.queue_times.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*QUEUE_TIME_BUCKETS, float("inf")), times.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            queue_time.add_metric([priority], buckets, sum_value=times.sum_s)
        yield queue_time
        yield from _speculative_metrics(stats.speculative)


def _speculative_metrics(by_proposer: Mapping[str, SpeculativeCounts]) -> Iterator[Metric]:
    """Drafts scored and kept, by proposer; nothing when the engine does not speculate. The
    two gauges are since the engine started: over a window, divide the counters' rates."""
    if not by_proposer:
        return
    labels = ("proposer",)
    draft_tokens = CounterMetricFamily(
        "tollway_engine_spec_decode_draft_tokens",
        "Draft tokens the target model scored.",
        labels=labels,
    )
    accepted_tokens = CounterMetricFamily(
        "tollway_engine_spec_decode_accepted_tokens",
        "Draft tokens the target model kept.",
        labels=labels,
    )
    verified_steps = CounterMetricFamily(
        "tollway_engine_spec_decode_verified_steps",
        "Sequence-steps that verified at least one draft token.",
        labels=labels,
    )
    acceptance_rate = GaugeMetricFamily(
        "tollway_engine_spec_decode_acceptance_rate",
        "Draft tokens kept per draft token scored, since the engine started.",
        labels=labels,
    )
    accepted_per_step = GaugeMetricFamily(
        "tollway_engine_spec_decode_accepted_tokens_per_step",
        "Draft tokens kept per verifying sequence-step (each also emits one of its own), "
        "since the engine started.",
        labels=labels,
    )
    for proposer, counts in sorted(by_proposer.items()):
        draft_tokens.add_metric([proposer], counts.num_draft_tokens)
        accepted_tokens.add_metric([proposer], counts.num_accepted_tokens)
        verified_steps.add_metric([proposer], counts.num_verified_chunks)
        acceptance_rate.add_metric([proposer], counts.acceptance_rate)
        accepted_per_step.add_metric([proposer], counts.accepted_tokens_per_chunk)
    yield from (draft_tokens, accepted_tokens, verified_steps, acceptance_rate, accepted_per_step)


class ServerMetrics:
    """The metrics of one app: a private registry, a request counter and a TTFT histogram."""

    def __init__(self, read_stats: Callable[[], EngineStats | None]) -> None:
        """``read_stats``: the engine's latest stats, or None while there is no engine."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(read_stats))
        self.requests = Counter(
            "tollway_engine_http_requests",
            "Generation requests answered, by endpoint and status code.",
            ("endpoint", "status"),
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "tollway_engine_time_to_first_token_seconds",
            "Seconds from accepting a request to its first generated token.",
            ("endpoint",),
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )

    def count_request(self, endpoint: str, status_code: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status_code)).inc()

    def observe_time_to_first_token(self, endpoint: str, seconds: float) -> None:
        self.time_to_first_token.labels(endpoint=endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
