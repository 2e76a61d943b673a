"""A model pool's load, read from its engines' ``/metrics`` and cached for about a second.

Queue depth is summed over the replicas, KV use is blocks used over blocks total across
them. A pool none of whose replicas answers has an unknown load (``None``), which the
routing policy treats as not saturated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.upstream.pool import UpstreamPool
from policies.model_routing import PoolLoad

DEFAULT_TTL_S = 1.0


class PoolLoadReader:
    def __init__(
        self,
        upstreams: UpstreamPool,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._upstreams = upstreams
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._cache: dict[str, tuple[float, PoolLoad | None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def load(self, model: str) -> PoolLoad | None:
        cached = self._cache.get(model)
        if cached is not None and self._clock() - cached[0] < self._ttl_s:
            return cached[1]
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:  # one scrape per expiry, however many requests wait
            cached = self._cache.get(model)
            if cached is not None and self._clock() - cached[0] < self._ttl_s:
                return cached[1]
            load = await self._scrape(model)
            self._cache[model] = (self._clock(), load)
            return load

    async def _scrape(self, model: str) -> PoolLoad | None:
        replicas = self._upstreams.replicas(model)
        texts = await asyncio.gather(*(self._fetch(base) for base in replicas))
        num_waiting, used, total, num_answered = 0, 0.0, 0.0, 0
        for text in texts:
            if text is None:
                continue
            values = parse_engine_gauges(text)
            num_answered += 1
            num_waiting += int(values.get("tollway_engine_requests_waiting", 0))
            used += values.get("tollway_engine_kv_blocks_used", 0.0)
            total += values.get("tollway_engine_kv_blocks_total", 0.0)
        if num_answered == 0:
            return None
        kv_usage = min(1.0, used / total) if total > 0 else 0.0
        return PoolLoad(num_waiting=num_waiting, kv_usage=kv_usage)

    async def _fetch(self, base: str) -> str | None:
        try:
            response = await self._upstreams.client.get(base + "/metrics", timeout=self._timeout_s)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None


def parse_engine_gauges(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values
