"""`ReplicaCache` follows a replica's kv_events lines (decoded: `engine_protocol.kv_events`);
`block_chain` is the engine's chain."""

from __future__ import annotations

import math

import pytest

from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request
from backend_engine.sampling_params import SamplingParams
from engine_protocol.kv_events import (
    PING,
    ClearedLine,
    EvictedLine,
    KvEventLine,
    LoadLine,
    SnapshotLine,
    StoredLine,
)
from gateway.upstream.prefix_index import (
    RECENT_REQUESTS_WINDOW_S,
    PrefixIndex,
    ReplicaCache,
    StreamOutOfSync,
    block_chain,
    cached_prefixes,
)

KEY = bytes(range(16))
TOKENS = list(range(100, 142))  # 42 tokens: 10 full blocks of 4, and 2 left over
CHAIN = block_chain(TOKENS, 4, KEY)


def snapshot(blocks: list[bytes], seq: int = 0, engine_id: str = "e1") -> SnapshotLine:
    return SnapshotLine(engine_id, seq, 4, KEY, tuple(blocks))


def test_block_chain_is_the_engines_own() -> None:
    """The hashes the engine's KV cache manager gives a request's blocks, for its extra key."""
    manager = KVCacheManager(num_blocks=32, block_size=4, extra_key=KEY)
    request = Request("r", TOKENS, SamplingParams(), max_tokens=1, arrival_seq=0)
    manager.get_computed_blocks(request)
    assert request.block_hashes == CHAIN
    assert len(CHAIN) == 10  # full blocks only
    assert block_chain(TOKENS, 4, b"other")[0] != CHAIN[0]  # the extra key seeds the chain
    assert block_chain(TOKENS[:3], 4, KEY) == []
    assert block_chain(TOKENS[:8], 4, KEY) == CHAIN[:2]


def test_the_stream_builds_the_replicas_block_set() -> None:
    cache = ReplicaCache()
    assert not cache.is_known
    cache.apply(snapshot(CHAIN[:3], seq=7))
    assert (cache.is_known, cache.engine_id, cache.seq, cache.block_size) == (True, "e1", 7, 4)
    assert cache.extra_key == KEY
    assert cache.cached_blocks(CHAIN) == 3
    cache.apply(StoredLine(8, tuple(CHAIN[3:6])))
    assert cache.cached_blocks(CHAIN) == 6
    cache.apply(PING)
    cache.apply(EvictedLine(9, (CHAIN[4],)))
    assert cache.cached_blocks(CHAIN) == 4  # a hit stops at the first missing block
    cache.apply(StoredLine(10, (CHAIN[4],)))
    assert cache.cached_blocks(CHAIN) == 6
    cache.apply(ClearedLine(11))
    assert cache.cached_blocks(CHAIN) == 0
    assert cache.seq == 11


def test_a_new_snapshot_replaces_everything() -> None:
    cache = ReplicaCache()
    cache.apply(snapshot(CHAIN, seq=50))
    cache.apply(snapshot(CHAIN[:1], seq=0, engine_id="e2"))  # the engine restarted
    assert (cache.engine_id, cache.seq, cache.cached_blocks(CHAIN)) == ("e2", 0, 1)
    cache.apply(StoredLine(1, (CHAIN[1],)))
    assert cache.cached_blocks(CHAIN) == 2


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([snapshot([], seq=3), StoredLine(5, (CHAIN[0],))], "seq 5 after 3"),
        ([snapshot([], seq=3), ClearedLine(3)], "seq 3 after 3"),
        ([snapshot([], seq=3), EvictedLine(2, (CHAIN[0],))], "seq 2 after 3"),
        ([StoredLine(1, (CHAIN[0],))], "before the snapshot"),
        ([LoadLine(0, 0, 0, 8), ClearedLine(1)], "before the snapshot"),
    ],
)
def test_lines_that_cannot_be_applied_put_the_stream_out_of_sync(
    events: list[KvEventLine], message: str
) -> None:
    """(Malformed lines never get here: decoding refuses them, tests/engine_protocol.)"""
    cache = ReplicaCache()
    *before, last = events
    for event in before:
        cache.apply(event)
    with pytest.raises(StreamOutOfSync, match=message):
        cache.apply(last)


def test_load_lines_replace_the_unreported_count() -> None:
    cache = ReplicaCache()
    cache.note_sent()
    cache.note_sent()
    assert cache.num_unreported == 2
    cache.apply(LoadLine(1, 3, 5, 20))
    assert cache.load == LoadLine(1, 3, 5, 20)
    assert cache.load.kv_usage == 0.25
    assert cache.num_unreported == 0


def test_forgetting_makes_the_state_unknown() -> None:
    cache = ReplicaCache()
    cache.apply(snapshot(CHAIN))
    cache.apply(LoadLine(0, 1, 1, 8))
    cache.forget()
    assert (cache.is_known, cache.load, cache.cached_blocks(CHAIN)) == (False, None, 0)


def test_the_index_keeps_one_cache_per_replica() -> None:
    index = PrefixIndex()
    a = index.replica("http://a")
    assert index.replica("http://a") is a
    assert index.replica("http://b") is not a
    index.remove("http://a")
    assert list(index) == ["http://b"]


def test_cached_prefixes_hash_the_chain_as_far_as_a_replica_holds_it() -> None:
    caches = [ReplicaCache() for _ in range(4)]
    for cache, blocks in zip(
        caches[:3], [CHAIN[:2], CHAIN[:7], CHAIN[:2] + CHAIN[3:]], strict=True
    ):
        cache.apply(snapshot(blocks))
    counts, own = cached_prefixes(TOKENS, 4, KEY, caches)
    assert counts == [2, 7, 2, 0] == [c.cached_blocks(CHAIN) for c in caches]
    assert own == CHAIN[7]  # the first block no replica holds names the prompt
    assert cached_prefixes(TOKENS[:28], 4, KEY, caches) == ([2, 7, 2, 0], CHAIN[6])  # all held
    assert cached_prefixes(TOKENS[:3], 4, KEY, caches) == ([0, 0, 0, 0], None)
    assert cached_prefixes(TOKENS, 4, b"another key", caches) == (
        [0, 0, 0, 0],
        block_chain(TOKENS, 4, b"another key")[0],
    )


def test_recent_requests_count_the_engines_counter_and_decay() -> None:
    now = [100.0]
    cache = ReplicaCache(clock=lambda: now[0])
    cache.apply(snapshot([]))

    def load(total: int | None) -> LoadLine:
        return LoadLine(0, 1, 0, 8, num_requests_total=total)

    cache.apply(load(500))  # the first reading: requests before it are not recent
    assert cache.recent.at(now[0]) == 0.0
    cache.apply(load(510))
    assert cache.recent.at(now[0]) == 10.0
    now[0] += RECENT_REQUESTS_WINDOW_S
    assert cache.recent.at(now[0]) == pytest.approx(10.0 / math.e)
    cache.apply(load(512))
    assert cache.recent.at(now[0]) == pytest.approx(10.0 / math.e + 2)
    cache.apply(load(3))  # the engine restarted: its counter begins again, nothing is added
    cache.apply(load(None))  # an engine that does not count
    assert cache.recent.at(now[0]) == pytest.approx(10.0 / math.e + 2)
    cache.apply(load(5))
    assert cache.recent.at(now[0]) == pytest.approx(10.0 / math.e + 4)
    assert cache.load is not None
    assert cache.load.num_requests_total == 5
