from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request
from backend_engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], arrival: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=16, arrival_seq=arrival)


def test_allocates_only_what_the_tokens_need():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(6)))
    alloc = kv.allocate_slots(req, 6)
    assert alloc is not None
    assert alloc.new_block_ids == (0, 1)
    req.num_computed_tokens = 6
    req.all_token_ids.append(100)
    # 7 tokens still fit in two blocks: nothing new.
    alloc = kv.allocate_slots(req, 1)
    assert alloc is not None
    assert alloc.new_block_ids == ()
    req.num_computed_tokens = 7
    req.all_token_ids.append(101)
    alloc = kv.allocate_slots(req, 1)  # token 8 of 8: still block 1
    assert alloc is not None
    assert alloc.new_block_ids == ()
    req.num_computed_tokens = 8
    req.all_token_ids.append(102)
    alloc = kv.allocate_slots(req, 1)
    assert alloc is not None
    assert alloc.new_block_ids == (2,)
    assert kv.block_table("a") == [0, 1, 2]


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12) is not None
    assert kv.block_table("a") == [0, 1, 2]

    same = make_request("b", list(range(12)))
    prefix = kv.get_computed_blocks(same)
    # All 12 tokens are cached but the last block is kept back so token 11 is computed.
    assert [b.block_id for b in prefix.blocks] == [0, 1]
    assert prefix.num_tokens == 8
    alloc = kv.allocate_slots(same, 4, prefix)
    assert alloc is not None
    assert alloc.new_block_ids == (3,)
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2

    other = make_request("c", [*range(4), 99, 99, 99, 99, 5])
    prefix = kv.get_computed_blocks(other)
    assert [b.block_id for b in prefix.blocks] == [0]
    assert kv.allocate_slots(other, 5, prefix) is not None
    assert kv.prefix_cache_hits == 8 + 4
    assert kv.prefix_cache_queries == 12 + 9


def test_the_metrics_count_admissions_not_lookups():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", list(range(9)))
    assert kv.allocate_slots(first, 9) is not None  # no cached prefix: not an admission lookup
    waiting = make_request("b", list(range(9)))
    for _ in range(3):  # a request that does not fit yet is looked up, not counted
        prefix = kv.get_computed_blocks(waiting)
        assert prefix.num_tokens == 8
        assert kv.allocate_slots(waiting, 1, prefix) is None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.free(first)
    assert kv.allocate_slots(waiting, 1, prefix) is not None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 8)


def test_a_lookup_goes_stale_when_its_free_blocks_are_handed_out():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5) is not None  # blocks 0, 1 full and cached
    kv.free(a)  # free list, LRU first: 2, 1, 0
    prefix = kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 9]))
    assert [blk.block_id for blk in prefix.blocks] == [0, 1]
    assert kv.is_still_cached(prefix)
    other = make_request("c", [7, 7, 7])
    assert kv.allocate_slots(other, 3) is not None  # takes blocks 2 and 1: 1 is evicted
    assert not kv.is_still_cached(prefix)


def test_freed_cached_blocks_are_revived_and_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5) is not None  # blocks 0,1,2; 0 and 1 full -> cached
    kv.free(a)  # free list: 3, 2, 1, 0
    assert kv.num_free_blocks == 4

    b = make_request("b", [1, 2, 3, 4, 7])
    prefix = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in prefix.blocks] == [0, 1]
    alloc = kv.allocate_slots(b, 1, prefix)
    assert alloc is not None
    assert alloc.new_block_ids == (3,)
    assert kv.block_table("b") == [0, 1, 3]


def test_no_room_returns_none_and_keeps_state():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None
    b = make_request("b", [50, 51])
    assert kv.allocate_slots(b, 2) is None
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 0


def test_reserved_blocks_are_respected():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8, num_reserved_blocks=3) is None
    assert kv.allocate_slots(a, 8, num_reserved_blocks=2) is not None


def test_caching_off_finds_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5) is not None
    prefix = kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))
    assert prefix.num_tokens == 0
    assert prefix.blocks == ()


def test_extra_key_separates_models():
    kv1 = KVCacheManager(num_blocks=8, block_size=2, extra_key=b"model-1")
    a = make_request("a", [1, 2, 3])
    assert kv1.allocate_slots(a, 3) is not None
    kv2 = KVCacheManager(num_blocks=8, block_size=2, extra_key=b"model-2")
    b = make_request("b", [1, 2, 3])
    kv2.get_computed_blocks(b)
    assert a.block_hashes[0] != b.block_hashes[0]


def test_freeing_a_failed_request_withdraws_its_unwritten_blocks_from_the_prefix_cache() -> None:
    """A request that failed mid-step: blocks past its computed tokens leave the cache,
    the ones before stay (their KV was written by earlier steps)."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("failed", list(range(12)))
    assert manager.allocate_slots(request, 8) is not None  # a first chunk: blocks 0-1
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 4) is not None  # the chunk that fails: block 2
    manager.free(request, num_written_tokens=request.num_computed_tokens)
    again = make_request("again", [*range(12), 99])
    assert manager.get_computed_blocks(again).num_tokens == 8
