"""The live replicas of every model: configured, discovered by DNS, checked, ejected.

A model's upstreams are fixed base URLs (``http(s)://``, or a ``unix:`` socket's private
host name) and ``dns://host:port`` names (`gateway.upstream.dns_discovery`), each of which
stands for the addresses it resolves to now. `ReplicaSet` keeps the current members and one
`ReplicaHealth` per member, and runs two background loops once started:

- every ``dns_refresh_s``, each DNS name is resolved again; a new address is checked once,
  then joins; an address that is gone leaves (requests already on it finish there: they
  hold their own connection). A failed resolution keeps the last good set, logged and
  counted in ``tollway_gateway_dns_resolution_failures_total``.
- every ``health_check_interval_s`` (0: never), every member is checked
  (`gateway.upstream.health_checks`); one that is not ready is skipped until it is.

``available(model)`` is what the pool picks from: the members that are ready and not
ejected, in configured order, or every member when none is (better a try than a certain
503). ``tollway_gateway_healthy_replicas`` counts the available ones per model, as of the
last check, change or ejection; ``tollway_gateway_replica_ejections_total`` the ejections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from gateway.observability.metrics import GatewayMetrics
from gateway.replica_settings import DnsUpstream, ReplicaWatch
from gateway.upstream.dns_discovery import Resolver, resolve_bases, system_resolver
from gateway.upstream.health_checks import is_replica_ready
from gateway.upstream.replica_health import ReplicaHealth

logger = logging.getLogger(__name__)

Upstream = str | DnsUpstream  # a fixed base URL, or a name to resolve
_DEFAULT_WATCH = ReplicaWatch()


class ReplicaSet:
    def __init__(
        self,
        upstreams: Mapping[str, Sequence[Upstream]],
        watch: ReplicaWatch = _DEFAULT_WATCH,
        *,
        resolver: Resolver = system_resolver,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_leave: Callable[[str], None] | None = None,
    ) -> None:
        """``on_leave(base)``: called when a replica leaves every model (forget its URLs)."""
        self._upstreams = {model: tuple(entries) for model, entries in upstreams.items()}
        self._watch = watch
        self._resolver = resolver
        self._metrics = metrics
        self._clock = clock
        self._on_leave = on_leave
        self._names = {
            entry.url: entry
            for entries in self._upstreams.values()
            for entry in entries
            if isinstance(entry, DnsUpstream)
        }
        self._resolved: dict[str, tuple[str, ...]] = {url: () for url in self._names}
        self._health: dict[str, ReplicaHealth] = {}
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def members(self, model: str) -> tuple[str, ...]:
        """Every replica of ``model`` now, in configured order (a name's, sorted)."""
        bases: list[str] = []
        for entry in self._upstreams[model]:
            found = self._resolved[entry.url] if isinstance(entry, DnsUpstream) else (entry,)
            bases += [base for base in found if base not in bases]
        return tuple(bases)

    def available(self, model: str) -> tuple[str, ...]:
        """The replicas that may take a request now; every member if none may."""
        members = self.members(model)
        now = self._clock()
        ready = tuple(base for base in members if self.health(base).is_available(now))
        return ready or members

    def health(self, base: str) -> ReplicaHealth:
        found = self._health.get(base)
        if found is None:
            found = self._health[base] = ReplicaHealth(self._watch.ejection)
        return found

    def record_success(self, base: str) -> None:
        health = self.health(base)
        was_ejected = health.num_ejections > 0
        health.record_success()
        if was_ejected:
            self._publish()

    def record_failure(self, model: str, base: str) -> None:
        """A request to ``base`` failed before its first token."""
        if self.health(base).record_failure(self._clock()):
            until = self._watch.ejection.backoff(self.health(base).num_ejections)
            logger.warning("replica %s of %s ejected for %.1f s", base, model, until)
            if self._metrics is not None:
                self._metrics.child(self._metrics.replica_ejections, model).inc()
            self._publish()

    async def start(self, client: httpx.AsyncClient) -> None:
        """Resolve every name and check every replica once, then keep doing so."""
        self._client = client
        await asyncio.gather(*(self.refresh(url) for url in self._names))
        if self._watch.health_check_interval_s > 0:
            await self.check(sorted(self._all_members()))
        self._publish()
        for url in self._names:
            self._tasks.append(asyncio.create_task(self._every(self._watch.dns_refresh_s, url)))
        if self._watch.health_check_interval_s > 0:
            interval = self._watch.health_check_interval_s
            self._tasks.append(asyncio.create_task(self._every(interval, None)))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def refresh(self, url: str) -> None:
        """Resolve one ``dns://`` upstream again and apply what changed."""
        upstream = self._names[url]
        try:
            bases = await resolve_bases(upstream, self._resolver)
        except OSError as exc:
            logger.warning(
                "resolving %s failed (%s); keeping its %d replica(s)",
                url,
                exc,
                len(self._resolved[url]),
            )
            if self._metrics is not None:
                self._metrics.child(self._metrics.dns_resolution_failures, url).inc()
            return
        old = self._resolved[url]
        if bases == old:
            return
        joined = [base for base in bases if base not in old]
        if joined and self._watch.health_check_interval_s > 0 and self._client is not None:
            await self.check(joined)  # a replica joins as ready only once it says so
        self._resolved[url] = bases
        left = set(old) - set(bases)
        logger.info("%s: %d replica(s); joined %s, left %s", url, len(bases), joined, sorted(left))
        still_members = self._all_members()
        for base in left - still_members:
            self._health.pop(base, None)
            if self._on_leave is not None:
                self._on_leave(base)
        self._publish()

    async def check(self, bases: Sequence[str]) -> None:
        """Run the active check on ``bases`` (concurrently) and record what it says."""
        client = self._client
        if client is None:
            return
        results = await asyncio.gather(*(is_replica_ready(client, base) for base in bases))
        for base, is_ready in zip(bases, results, strict=True):
            health = self.health(base)
            if health.is_ready != is_ready:
                logger.warning("replica %s is %s", base, "ready" if is_ready else "not ready")
            health.is_ready = is_ready

    async def _every(self, interval_s: float, url: str | None) -> None:
        """Refresh ``url`` (or, for None, check every member) every ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                if url is not None:
                    await self.refresh(url)
                else:
                    await self.check(sorted(self._all_members()))
                    self._publish()
            except Exception:  # a bug here must not stop discovery for good
                logger.exception("replica watch of %s failed", url or "health checks")

    def _all_members(self) -> set[str]:
        return {base for model in self._upstreams for base in self.members(model)}

    def _publish(self) -> None:
        if self._metrics is None:
            return
        now = self._clock()
        for model in self._upstreams:
            num_healthy = sum(self.health(b).is_available(now) for b in self.members(model))
            self._metrics.child(self._metrics.healthy_replicas, model).set(num_healthy)
