"""The prefix cache's events: exactly what the block pool reports for each change a lookup
can see, and the numbered lines and hash set `KVEventLog` keeps from them."""

from __future__ import annotations

import random

import orjson

from backend_engine.core.block_pool import BlockPool
from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.kv_event_log import (
    BlockEvicted,
    BlockStored,
    CacheCleared,
    KVCacheEvent,
    KVEventLog,
)
from backend_engine.core.request import Request
from backend_engine.sampling_params import SamplingParams
from engine_protocol.block_hash import hash_block
from engine_protocol.kv_events import ClearedLine, EvictedLine, SnapshotLine, StoredLine, encode

KEY = b"model"
H0 = hash_block(None, [1, 2], KEY)
H1 = hash_block(H0, [3, 4], KEY)
H2 = hash_block(None, [9, 9], KEY)


def _pool(num_blocks: int) -> tuple[BlockPool, list[KVCacheEvent]]:
    events: list[KVCacheEvent] = []
    return BlockPool(num_blocks, events=events), events


def test_caching_a_block_stores_its_hash_once() -> None:
    pool, events = _pool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    assert events == []  # fresh blocks held nothing findable
    pool.cache(blocks[0], H0)
    pool.cache(blocks[1], H1)
    pool.cache(blocks[0], H0)  # already registered: no change
    pool.cache(blocks[2], H0)  # an identical block is cached: this one stays private
    assert events == [BlockStored(0, H0), BlockStored(1, H1)]


def test_free_and_revive_report_nothing_and_reuse_evicts_lru() -> None:
    pool, events = _pool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    for block, block_hash in zip(blocks, (H0, H1, H2), strict=True):
        pool.cache(block, block_hash)
    events.clear()

    pool.free([blocks[2], blocks[0], blocks[1]])  # LRU order: 2, 0, 1; still findable
    pool.touch([blocks[0]])  # a prefix-cache hit revives block 0
    assert events == []

    assert [b.block_id for b in pool.allocate(1) or []] == [2]
    assert events == [BlockEvicted(2, H2)]
    assert [b.block_id for b in pool.allocate(1) or []] == [1]
    assert events == [BlockEvicted(2, H2), BlockEvicted(1, H1)]
    assert pool.cached_hashes == {H0}


def test_a_failed_allocation_reports_nothing() -> None:
    pool, events = _pool(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache(blocks[0], H0)
    pool.free(blocks)
    events.clear()
    assert pool.allocate(3) is None
    assert events == []


def test_uncache_and_reset() -> None:
    pool, events = _pool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    for block, block_hash in zip(blocks, (H0, H1, H2), strict=True):
        pool.cache(block, block_hash)
    pool.uncache([blocks[1], blocks[1]])  # the second time it holds no hash any more
    pool.reset_prefix_cache()
    assert events == [
        BlockStored(0, H0),
        BlockStored(1, H1),
        BlockStored(2, H2),
        BlockEvicted(1, H1),
        CacheCleared(),
    ]
    assert pool.cached_hashes == frozenset()


def test_a_pool_without_an_event_list_reports_nowhere() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache(blocks[0], H0)
    pool.free(blocks)
    pool.allocate(2)
    assert pool.cached_hashes == frozenset()


def test_the_log_numbers_lines_and_groups_runs_of_one_kind() -> None:
    log = KVEventLog(block_size=16, extra_key=KEY, engine_id="e1")
    lines = log.record([BlockStored(0, H0), BlockStored(1, H1), BlockEvicted(1, H1)])
    assert lines == [StoredLine(1, (H0, H1)), EvictedLine(2, (H1,))]
    assert log.record([]) == []
    lines = log.record([CacheCleared(), CacheCleared(), BlockStored(2, H2), BlockStored(0, H0)])
    assert lines == [ClearedLine(3), ClearedLine(4), StoredLine(5, (H2, H0))]
    assert log.snapshot() == SnapshotLine("e1", 5, 16, KEY, tuple(sorted([H0, H2])))


def test_the_snapshot_is_the_old_wire_line() -> None:
    """Sorted as the hex strings were (engines and gateways of either age read each other)."""
    log = KVEventLog(block_size=16, extra_key=KEY, engine_id="e1")
    hashes = [hash_block(None, [i], KEY) for i in range(50)]
    log.record([BlockStored(i, h) for i, h in enumerate(hashes)])
    old_line = {
        "type": "snapshot",
        "engine_id": "e1",
        "seq": 1,
        "block_size": 16,
        "extra_key": KEY.hex(),
        "blocks": sorted(h.hex() for h in hashes),
    }
    assert encode(log.snapshot()) == orjson.dumps(old_line) + b"\n"


def test_each_log_has_its_own_engine_id() -> None:
    first, second = KVEventLog(16, KEY), KVEventLog(16, KEY)
    assert first.engine_id != second.engine_id
    assert len(first.engine_id) == 32
    assert int(first.engine_id, 16) >= 0
    assert first.snapshot().seq == 0
    assert first.snapshot().blocks == ()


def test_the_log_follows_the_cache_through_real_requests() -> None:
    # The scheduler's own calls (lookup, allocate with a cached prefix, free tail first,
    # eviction under pressure, a failed step's uncache): after every call, the hashes the
    # events describe are exactly the ones a lookup finds.
    events: list[KVCacheEvent] = []
    manager = KVCacheManager(num_blocks=12, block_size=4, extra_key=KEY, kv_events=events)
    log = KVEventLog(4, KEY)
    rng = random.Random(0)
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 2):
            request = live.pop(rng.randrange(len(live)))
            failed = rng.random() < 0.2
            manager.free(request, num_written_tokens=0 if failed else None)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(9))]
            request = Request(f"r{step}", tokens, SamplingParams(), max_tokens=1, arrival_seq=step)
            prefix = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix):
                request.num_computed_tokens = len(tokens)
                live.append(request)
        log.record(events)
        events.clear()
        assert log.hashes == manager.pool.cached_hashes, step
    assert manager.pool.num_evictions > 0  # the run did evict
