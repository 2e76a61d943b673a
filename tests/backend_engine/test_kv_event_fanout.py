"""Fanning the prefix-cache events out: a snapshot and the lines after it meet exactly, every
subscriber gets every line, and one that falls its buffer behind is dropped alone."""

from __future__ import annotations

import pytest

from backend_engine.core.kv_event_log import BlockEvicted, BlockStored, CacheCleared, KVEventLog
from backend_engine.kv_event_fanout import KVEventFanout
from engine_protocol.block_hash import hash_block
from engine_protocol.kv_events import ClearedLine, EvictedLine, StoredLine, decode, encode

KEY = b"model"
HASHES = [hash_block(None, [i], KEY) for i in range(8)]


def _fanout(buffer_lines: int = 16) -> KVEventFanout:
    return KVEventFanout(KVEventLog(16, KEY, engine_id="e"), buffer_lines)


async def test_a_snapshot_and_the_lines_after_it_meet_exactly() -> None:
    fanout = _fanout()
    fanout.publish([BlockStored(0, HASHES[0]), BlockStored(1, HASHES[1])])
    snapshot, subscription = fanout.subscribe()
    assert snapshot.seq == 1
    assert snapshot.blocks == tuple(sorted([HASHES[0], HASHES[1]]))
    fanout.publish([BlockEvicted(0, HASHES[0])])
    fanout.publish([CacheCleared()])
    await subscription.wait(1.0)
    assert subscription.take() == [encode(EvictedLine(2, (HASHES[0],))), encode(ClearedLine(3))]
    assert subscription.take() == []


async def test_every_subscriber_gets_every_line_from_its_own_snapshot() -> None:
    fanout = _fanout()
    first_snapshot, first = fanout.subscribe()
    fanout.publish([BlockStored(0, HASHES[0])])
    second_snapshot, second = fanout.subscribe()
    fanout.publish([BlockStored(1, HASHES[1])])
    assert (first_snapshot.seq, second_snapshot.seq) == (0, 1)
    assert [decode(line) for line in first.take()] == [
        StoredLine(1, (HASHES[0],)),
        StoredLine(2, (HASHES[1],)),
    ]
    assert [decode(line) for line in second.take()] == [StoredLine(2, (HASHES[1],))]
    assert fanout.num_subscriptions == 2


async def test_a_subscriber_that_falls_behind_is_dropped_alone() -> None:
    fanout = _fanout(buffer_lines=3)
    _, slow = fanout.subscribe()
    _, fast = fanout.subscribe()
    for index in range(3):
        fanout.publish([BlockStored(index, HASHES[index])])
        if index < 2:
            assert len(fast.take()) == 1
    assert not slow.is_closed  # exactly full
    fast.take()
    fanout.publish([BlockStored(3, HASHES[3])])  # one line too many for the slow one
    assert slow.is_closed
    assert slow.is_overflowed
    assert slow.take() == []
    await slow.wait(10.0)  # returns at once: it is closed
    assert fast.take() == [encode(StoredLine(4, (HASHES[3],)))]
    assert fanout.num_subscriptions == 1


async def test_every_subscriber_gets_the_same_bytes_encoded_once() -> None:
    fanout = _fanout()
    subscriptions = [fanout.subscribe()[1] for _ in range(3)]
    fanout.publish([BlockStored(0, HASHES[0]), BlockEvicted(0, HASHES[0])])
    first, *others = [subscription.take() for subscription in subscriptions]
    assert all(line is mine for taken in others for line, mine in zip(taken, first, strict=True))
    assert [decode(line) for line in first] == [
        StoredLine(1, (HASHES[0],)),
        EvictedLine(2, (HASHES[0],)),
    ]


async def test_wait_returns_when_a_line_arrives_or_after_its_timeout() -> None:
    fanout = _fanout()
    _, subscription = fanout.subscribe()
    await subscription.wait(0.01)
    assert subscription.take() == []
    fanout.publish([BlockStored(0, HASHES[0])])
    await subscription.wait(10.0)
    assert len(subscription.take()) == 1


async def test_closing_ends_every_subscription_and_later_ones() -> None:
    fanout = _fanout()
    _, subscription = fanout.subscribe()
    fanout.close()
    assert subscription.is_closed
    assert not subscription.is_overflowed
    snapshot, late = fanout.subscribe()
    assert late.is_closed
    assert snapshot.seq == 0
    fanout.unsubscribe(subscription)  # harmless after the close


def test_a_buffer_holds_at_least_one_line() -> None:
    with pytest.raises(ValueError, match="buffer_lines must be positive"):
        _fanout(buffer_lines=0)
