"""One task per engine replica that follows its ``GET /kv_events`` stream into the index.

`KvEventSubscriber.run` connects, decodes each line once (`engine_protocol.kv_events.decode`)
and applies it to the replica's `ReplicaCache`, and on any end of the stream (a refused or
failed connection, an answer other than 200, the stream closing, no line for
``read_timeout_s`` although the engine pings every 5 s, a malformed line or one that puts it
out of sync) forgets the replica's state, which is unknown until the next snapshot, and
connects again after a backoff: ``backoff_initial_s``, doubled after each failure up to
``backoff_max_s``, back to the start once a snapshot arrives. A foreign server that has no
such route (404) is asked again every ``backoff_max_s``, and routed by load meanwhile. A line
of a type this gateway does not know (a newer engine's) is skipped, as the format says.

`KvEventSubscriptions` keeps one subscriber task per replica, for a replica set that may
change (`sync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import httpx

from engine_protocol.kv_events import MEDIA_TYPE, KvEventLineError, UnknownLineType, decode
from gateway.upstream.prefix_index import PrefixIndex, ReplicaCache, StreamOutOfSync

logger = logging.getLogger(__name__)

KV_EVENTS_PATH = "/kv_events"
# One event line at most (a snapshot of a large engine's cache is a few MB); a server that
# sends more without a newline is not an engine's stream, and is not buffered further.
MAX_EVENT_LINE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SubscriberTiming:
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 15.0  # three missed pings
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "read_timeout_s", "backoff_initial_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be at least backoff_initial_s")


class _StreamEnded(Exception):
    pass


class KvEventSubscriber:
    def __init__(
        self,
        client: httpx.AsyncClient,
        base: str,
        cache: ReplicaCache,
        timing: SubscriberTiming = SubscriberTiming(),
    ) -> None:
        self._client = client
        self._url = base.rstrip("/") + KV_EVENTS_PATH
        self._cache = cache
        self._timing = timing
        self.num_connections = 0  # attempts made, for tests and logs

    async def run(self) -> None:
        """Follow the stream until cancelled."""
        delay = self._timing.backoff_initial_s
        while True:
            try:
                await self._follow()
            except Exception as exc:  # whatever ends it, the replica is followed again
                was_known = self._cache.is_known
                if was_known:
                    delay = self._timing.backoff_initial_s
                expected = isinstance(
                    exc, httpx.HTTPError | StreamOutOfSync | KvEventLineError | _StreamEnded
                )
                # Said once per outage: a server without the stream is asked every 10 s.
                is_news = was_known or self.num_connections == 1 or not expected
                logger.log(
                    (logging.INFO if expected else logging.WARNING) if is_news else logging.DEBUG,
                    "kv_events %s: %r; reconnecting in %.1f s",
                    self._url,
                    exc,
                    delay,
                )
            finally:
                self._cache.forget()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._timing.backoff_max_s)

    async def _follow(self) -> None:
        self.num_connections += 1
        timing = self._timing
        timeout = httpx.Timeout(
            connect=timing.connect_timeout_s, read=timing.read_timeout_s, write=5.0, pool=5.0
        )
        async with self._client.stream("GET", self._url, timeout=timeout) as response:
            if response.status_code != 200:
                raise _StreamEnded(f"status {response.status_code}")
            media_type = response.headers.get("content-type", "").split(";")[0].strip()
            if media_type != MEDIA_TYPE:
                raise _StreamEnded(f"content-type {media_type or 'none'}, not an event stream")
            async for data in event_lines(response.aiter_bytes()):
                if not data or data.isspace():
                    continue
                try:
                    line = decode(data)  # KvEventLineError: the stream cannot be followed
                except UnknownLineType as exc:
                    logger.debug(
                        "kv_events %s: skipped a line of type %r", self._url, exc.line_type
                    )
                    continue
                self._cache.apply(line)
        raise _StreamEnded("the stream closed")


async def event_lines(
    chunks: AsyncIterator[bytes], max_line_bytes: int = MAX_EVENT_LINE_BYTES
) -> AsyncIterator[bytes]:
    """The newline-ended lines of ``chunks``; `StreamOutOfSync` for a line longer than
    ``max_line_bytes`` (what is buffered stays bounded)."""
    pending = bytearray()
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if len(pending) + end - start > max_line_bytes:
                raise StreamOutOfSync(f"an event line over {max_line_bytes} bytes")
            if pending:
                pending += chunk[start:end]
                yield bytes(pending)
                pending.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        pending += chunk[start:]
        if len(pending) > max_line_bytes:
            raise StreamOutOfSync(f"an event line over {max_line_bytes} bytes")


class KvEventSubscriptions:
    """A subscriber task per replica, started and stopped as the replica set changes."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        index: PrefixIndex,
        timing: SubscriberTiming = SubscriberTiming(),
    ) -> None:
        self._client = client
        self._index = index
        self._timing = timing
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.subscribers: dict[str, KvEventSubscriber] = {}

    def sync(self, replicas: Iterable[str]) -> None:
        """Follow exactly ``replicas`` (base URLs): start the new ones, stop the gone ones."""
        wanted = set(replicas)
        for base in set(self._tasks) - wanted:
            self._tasks.pop(base).cancel()
            self.subscribers.pop(base)
            self._index.remove(base)
        for base in sorted(wanted - set(self._tasks)):
            subscriber = KvEventSubscriber(
                self._client, base, self._index.replica(base), self._timing
            )
            self.subscribers[base] = subscriber
            self._tasks[base] = asyncio.create_task(subscriber.run(), name=f"kv_events {base}")

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.subscribers.clear()
