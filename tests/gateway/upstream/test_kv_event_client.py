"""`KvEventSubscriber` follows a stand-in engine's kv_events stream over real HTTP (a Unix
socket, through the pool's own client): snapshot, changes, loss of sync, restarts, silence."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from gateway.settings import ModelSettings
from gateway.upstream.kv_event_client import (
    KvEventSubscriptions,
    SubscriberTiming,
    event_lines,
)
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.prefix_index import PrefixIndex, StreamOutOfSync, block_chain
from tests.gateway.upstream.kv_events_stand_in import StandInKvEvents
from tests.support.polling import eventually

KEY = bytes(16)
CHAIN = block_chain(list(range(64)), 4, KEY)  # 16 blocks
FAST = SubscriberTiming(read_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.2)


@pytest.fixture
def engine() -> Iterator[StandInKvEvents]:
    server = StandInKvEvents(block_size=4, extra_key=KEY).start()
    yield server
    server.stop()


@asynccontextmanager
async def following(
    *engines: StandInKvEvents, timing: SubscriberTiming = FAST
) -> AsyncIterator[tuple[PrefixIndex, KvEventSubscriptions, list[str]]]:
    upstreams = tuple(e.upstream for e in engines)
    pool = UpstreamPool({"m": ModelSettings("m", upstreams, 64)})
    bases = pool.replicas("m")  # the first call: in the engines' order
    index = PrefixIndex()
    subscriptions = KvEventSubscriptions(pool.client, index, timing)
    subscriptions.sync(bases)
    try:
        yield index, subscriptions, bases
    finally:
        await subscriptions.aclose()
        await pool.aclose()


async def test_the_index_follows_snapshot_and_changes(engine: StandInKvEvents) -> None:
    engine.store(CHAIN[:3])
    async with following(engine) as (index, _, [base]):
        cache = index.replica(base)
        await eventually(lambda: cache.cached_blocks(CHAIN) == 3, what="the snapshot")
        assert (cache.engine_id, cache.seq, cache.block_size, cache.extra_key) == (
            engine.engine_id,
            1,
            4,
            KEY,
        )
        engine.store(CHAIN[3:7])
        await eventually(lambda: cache.cached_blocks(CHAIN) == 7, what="a stored event")
        engine.evict(CHAIN[5:6])
        await eventually(lambda: cache.cached_blocks(CHAIN) == 5, what="an evicted event")
        engine.set_load(num_waiting=2, num_running=5, kv_blocks_used=16)
        await eventually(lambda: cache.load is not None and cache.load.num_running == 5)
        assert cache.load is not None
        assert cache.load.kv_usage == 0.25
        engine.clear()
        await eventually(lambda: cache.cached_blocks(CHAIN) == 0, what="a cleared event")
        assert cache.is_known
        assert engine.num_connections == 1


async def test_a_seq_gap_resyncs_from_a_new_snapshot(engine: StandInKvEvents) -> None:
    async with following(engine) as (index, _, [base]):
        cache = index.replica(base)
        await eventually(lambda: cache.is_known)
        engine.store(CHAIN[:2])  # seq 1
        await eventually(lambda: cache.seq == 1)
        # a line the client cannot apply: seq 3 after 1 (an event was lost)
        engine.blocks.update(CHAIN[2:4])
        engine.seq = 3
        engine.send_raw(
            json.dumps({"type": "stored", "seq": 3, "blocks": [CHAIN[3].hex()]}).encode() + b"\n"
        )
        await eventually(lambda: engine.num_connections == 2 and cache.is_known, what="a resync")
        assert cache.seq == 3
        assert cache.cached_blocks(CHAIN) == 4


async def test_a_malformed_line_resyncs_and_an_unknown_type_is_skipped(
    engine: StandInKvEvents,
) -> None:
    """A newer engine's line of a new type is skipped, the stream followed on; a line that
    is not one (bad hex here) ends it, and a new connection brings a new snapshot."""
    async with following(engine) as (index, _, [base]):
        cache = index.replica(base)
        await eventually(lambda: cache.is_known)
        engine.send_raw(b'{"type": "newer_engines_stats", "num_widgets": 3}\n')
        engine.store(CHAIN[:2])  # seq 1, after the unknown line
        await eventually(lambda: cache.cached_blocks(CHAIN) == 2, what="the line after it")
        assert engine.num_connections == 1
        engine.send_raw(b'{"type": "stored", "seq": 2, "blocks": ["not hex"]}\n')
        await eventually(lambda: engine.num_connections == 2 and cache.is_known, what="a resync")
        assert cache.seq == 1
        assert cache.cached_blocks(CHAIN) == 2


async def test_an_engine_restart_is_a_new_engine(engine: StandInKvEvents) -> None:
    engine.store(CHAIN)
    async with following(engine) as (index, _, [base]):
        cache = index.replica(base)
        await eventually(lambda: cache.cached_blocks(CHAIN) == len(CHAIN))
        old_id = engine.engine_id
        engine.restart()
        await eventually(lambda: cache.is_known and cache.engine_id == engine.engine_id)
        assert cache.engine_id != old_id
        assert cache.seq == 0
        assert cache.cached_blocks(CHAIN) == 0


async def test_a_server_without_the_stream_stays_unknown_and_is_asked_again(
    engine: StandInKvEvents,
) -> None:
    engine.status = 404
    async with following(engine) as (index, _, [base]):
        await eventually(lambda: engine.num_connections >= 3, what="retries with backoff")
        assert not index.replica(base).is_known
        engine.status = 200
        await eventually(lambda: index.replica(base).is_known, what="the stream, once served")


async def test_a_200_that_is_not_an_event_stream_stays_unknown(engine: StandInKvEvents) -> None:
    """A foreign server answering /kv_events with a page of its own is not followed."""
    engine.media_type = b"text/html; charset=utf-8"
    engine.store(CHAIN[:2])
    async with following(engine) as (index, _, [base]):
        await eventually(lambda: engine.num_connections >= 2, what="asked again with backoff")
        assert not index.replica(base).is_known
        engine.media_type = b"application/x-ndjson; charset=utf-8"
        await eventually(lambda: index.replica(base).is_known, what="the stream, once served")


async def _chunks(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def test_event_lines_are_cut_at_newlines_across_chunks_and_bounded() -> None:
    lines = [line async for line in event_lines(_chunks(b'{"a"', b": 1}\n\n{", b'"b": 2}\n'))]
    assert lines == [b'{"a": 1}', b"", b'{"b": 2}']
    assert [line async for line in event_lines(_chunks(b"1234\n", b"12"), 4)] == [b"1234"]
    with pytest.raises(StreamOutOfSync, match="over 4 bytes"):
        [line async for line in event_lines(_chunks(b"123", b"45\n"), 4)]
    with pytest.raises(StreamOutOfSync, match="over 4 bytes"):  # no newline ever: bounded
        [line async for line in event_lines(_chunks(b"123", b"45", b"67"), 4)]


async def test_a_disconnect_or_a_silent_stream_makes_the_state_unknown(
    engine: StandInKvEvents,
) -> None:
    engine.store(CHAIN[:2])
    slow_retry = SubscriberTiming(read_timeout_s=0.5, backoff_initial_s=30, backoff_max_s=30)
    async with following(engine, timing=slow_retry) as (index, _, [base]):
        cache = index.replica(base)
        await eventually(lambda: cache.is_known)
        engine.drop_streams()
        await eventually(lambda: not cache.is_known, what="unknown once disconnected")
        assert cache.cached_blocks(CHAIN) == 0
    async with following(engine, timing=slow_retry) as (index, _, [base]):
        cache = index.replica(base)
        await eventually(lambda: cache.is_known)
        # no line at all for read_timeout_s (an engine pings every 5 s): the stream is dead
        await eventually(lambda: not cache.is_known, timeout_s=5, what="a silent stream")


async def test_subscriptions_follow_the_replica_set() -> None:
    a = StandInKvEvents(4, KEY).start()
    b = StandInKvEvents(4, KEY).start()
    try:
        a.store(CHAIN[:1])
        b.store(CHAIN[:2])
        async with following(a, b) as (index, subscriptions, [base_a, base_b]):
            await eventually(lambda: index.replica(base_a).cached_blocks(CHAIN) == 1)
            await eventually(lambda: index.replica(base_b).cached_blocks(CHAIN) == 2)
            subscriptions.sync([base_b])
            assert list(index) == [base_b]
            assert set(subscriptions.subscribers) == {base_b}
            await eventually(lambda: a.num_streams == 0, what="a's stream closed")
            assert b.num_streams == 1
    finally:
        a.stop()
        b.stop()


def test_timing_is_validated() -> None:
    with pytest.raises(ValueError, match="read_timeout_s must be > 0"):
        SubscriberTiming(read_timeout_s=0)
    with pytest.raises(ValueError, match="backoff_max_s"):
        SubscriberTiming(backoff_initial_s=2, backoff_max_s=1)
