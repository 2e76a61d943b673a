"""``GET /kv_events``: the engine's prefix-cache events and load, as newline-delimited JSON.

The stream (its lines and their format: `engine_protocol.kv_events`)::

    {"type": "snapshot", "engine_id": ..., "seq": 7, "block_size": 16, "extra_key": ...,
     "blocks": [...]}
    {"type": "load", "num_waiting": 0, "num_running": 1, "kv_blocks_used": 3,
     "kv_blocks_total": 512, "num_requests_total": 40}
    {"type": "stored", "seq": 8, "blocks": [...]}
    ...

- the snapshot first, then every event line after it, in order (`KVEventFanout`);
- a ``load`` line right after the snapshot, then whenever one of its numbers has changed,
  at most ``1 / LOAD_INTERVAL_S`` a second (``num_requests_total`` counts the requests
  queued since the engine started: a gateway reckons the replica's recent traffic from it);
- a ``ping`` line after ``PING_AFTER_S`` without any other line.

It never ends by itself while the engine serves; it ends when this listener falls more than
its buffer behind or when the engine shuts down. A 503 ``engine_not_ready`` while the model
loads (there is no cache, nor an extra key, yet).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from backend_engine.async_engine import AsyncEngine
from backend_engine.kv_event_fanout import KVEventSubscription
from backend_engine.outputs import EngineStats
from backend_engine.server.context import ServerContext
from engine_protocol.kv_events import MEDIA_TYPE, PING, LoadLine, SnapshotLine, encode
from openai_protocol.sse import EventStreamResponse

LOAD_INTERVAL_S = 0.05  # at most 20 load lines a second per stream
PING_AFTER_S = 5.0
PING_BYTES = encode(PING)


class NDJSONStreamResponse(EventStreamResponse):
    """`EventStreamResponse`'s clean-up and disconnect handling, for JSON lines."""

    media_type = MEDIA_TYPE


async def kv_events(request: Request) -> Response:
    engine = ServerContext.of(request).host.built_engine()
    snapshot, subscription = engine.kv_events.subscribe()

    async def on_close() -> None:
        engine.kv_events.unsubscribe(subscription)

    return NDJSONStreamResponse(_lines(engine, snapshot, subscription), on_close=on_close)


def load_line(stats: EngineStats) -> LoadLine:
    return LoadLine(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        kv_blocks_used=stats.num_kv_blocks_used,
        kv_blocks_total=stats.num_kv_blocks_total,
        num_requests_total=stats.num_requests,
    )


async def _lines(
    engine: AsyncEngine, snapshot: SnapshotLine, subscription: KVEventSubscription
) -> AsyncIterator[str]:
    load = load_line(engine.stats())
    yield (encode(snapshot) + encode(load)).decode()
    load_sent_at = last_line_at = time.monotonic()
    while True:
        # Wakes at least every LOAD_INTERVAL_S, to look at the load.
        await subscription.wait(LOAD_INTERVAL_S)
        lines = subscription.take()  # encoded once, by the fanout, for every subscriber
        if subscription.is_closed:
            return
        now = time.monotonic()
        current = load_line(engine.stats())
        if current != load and now - load_sent_at >= LOAD_INTERVAL_S:
            lines.append(encode(current))
            load, load_sent_at = current, now
        if not lines and now - last_line_at >= PING_AFTER_S:
            lines.append(PING_BYTES)
        if lines:
            yield b"".join(lines).decode()  # EventStreamResponse sends text
            last_line_at = now
