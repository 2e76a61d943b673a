"""The prefix-cache events of one engine, fanned out to every listener of ``GET /kv_events``.

The engine thread hands each step's pool events to the event loop (`AsyncEngine`), which
calls :meth:`KVEventFanout.publish`; a listener subscribes on the same loop. Both run on that
one thread, so a subscription's snapshot and the lines it then receives meet exactly: every
line recorded after the snapshot, none before::

    snapshot (seq 7)  ->  stored 8, evicted 9, ...     (no gap, no repeat)

`publish` encodes each line once (`engine_protocol.kv_events.encode`) and hands the same
bytes to every subscription. Each subscription buffers at most ``buffer_lines`` lines. A
listener that falls that far behind is closed (``is_overflowed``): it has missed nothing yet,
but holding more for it would let one slow reader grow the engine's memory without bound; it
reconnects and gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable

from backend_engine.core.kv_event_log import KVCacheEvent, KVEventLog
from engine_protocol.kv_events import SnapshotLine, encode

DEFAULT_BUFFER_LINES = 4096


class KVEventSubscription:
    """One listener's queue of encoded lines; read only from the event loop's thread."""

    def __init__(self, buffer_lines: int) -> None:
        self.buffer_lines = buffer_lines
        self._lines: deque[bytes] = deque()
        self._has_lines = asyncio.Event()
        self.is_closed = False
        self.is_overflowed = False

    def offer(self, lines: list[bytes]) -> None:
        if self.is_closed:
            return
        if len(self._lines) + len(lines) > self.buffer_lines:
            self.is_overflowed = True
            self.close()
            return
        self._lines.extend(lines)
        self._has_lines.set()

    def close(self) -> None:
        self.is_closed = True
        self._lines.clear()
        self._has_lines.set()

    async def wait(self, timeout_s: float) -> None:
        """Return once lines are waiting, the subscription is closed, or ``timeout_s`` passed."""
        if self._lines or self.is_closed:
            return
        with contextlib.suppress(asyncio.TimeoutError):  # not yet the builtin on Python 3.10
            await asyncio.wait_for(self._has_lines.wait(), timeout_s)

    def take(self) -> list[bytes]:
        """Every line waiting, oldest first (none once closed)."""
        lines = list(self._lines)
        self._lines.clear()
        self._has_lines.clear()
        return lines


class KVEventFanout:
    def __init__(self, log: KVEventLog, buffer_lines: int = DEFAULT_BUFFER_LINES) -> None:
        if buffer_lines < 1:
            raise ValueError(f"buffer_lines must be positive, got {buffer_lines}")
        self.log = log
        self.buffer_lines = buffer_lines
        self._subscriptions: set[KVEventSubscription] = set()
        self.is_closed = False

    @property
    def num_subscriptions(self) -> int:
        return len(self._subscriptions)

    def subscribe(self) -> tuple[SnapshotLine, KVEventSubscription]:
        """The snapshot line and a subscription to every line after it."""
        subscription = KVEventSubscription(self.buffer_lines)
        if self.is_closed:
            subscription.close()
        else:
            self._subscriptions.add(subscription)
        return self.log.snapshot(), subscription

    def unsubscribe(self, subscription: KVEventSubscription) -> None:
        subscription.close()
        self._subscriptions.discard(subscription)

    def publish(self, events: Iterable[KVCacheEvent]) -> None:
        lines = self.log.record(events)
        if not lines or not self._subscriptions:
            return
        encoded = [encode(line) for line in lines]
        for subscription in list(self._subscriptions):
            subscription.offer(encoded)
            if subscription.is_closed:
                self._subscriptions.discard(subscription)

    def close(self) -> None:
        """End every subscription (the engine is going away); later ones start closed."""
        self.is_closed = True
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions.clear()
