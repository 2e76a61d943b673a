import pytest

from backend_engine.core.block_pool import BlockPool
from engine_protocol.block_hash import hash_block


def test_allocate_hands_out_lowest_ids_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks is not None
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing


def test_free_appends_in_given_order_and_reuses_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a is not None
    assert b is not None
    pool.free(reversed(b))  # tail first: block 3 then 2
    pool.free(reversed(a))  # then 1, 0
    again = pool.allocate(4)
    assert again is not None
    assert [blk.block_id for blk in again] == [3, 2, 1, 0]


def test_cached_block_is_revived_by_touch_and_evicted_lru():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    h0 = hash_block(None, [1, 2], b"m")
    h1 = hash_block(h0, [3, 4], b"m")
    h2 = hash_block(None, [9, 9], b"m")
    pool.cache(blocks[0], h0)
    pool.cache(blocks[1], h1)
    pool.cache(blocks[2], h2)
    pool.free([blocks[2], blocks[0], blocks[1]])  # LRU order: 2, 0, 1
    assert pool.num_free_blocks == 3
    assert pool.lookup(h0) is blocks[0]

    pool.touch([blocks[0]])  # a hit takes block 0 out of the free list
    assert blocks[0].ref_cnt == 1
    assert pool.num_free_blocks == 2

    first = pool.allocate(1)
    assert first is not None
    assert first[0].block_id == 2
    assert pool.lookup(h2) is None  # its hash was evicted
    assert pool.num_evictions == 1
    second = pool.allocate(1)
    assert second is not None
    assert second[0].block_id == 1
    assert pool.lookup(h1) is None
    assert pool.lookup(h0) is blocks[0]  # still referenced, still cached


def test_shared_block_needs_every_reference_dropped():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.touch(blocks)
    assert blocks[0].ref_cnt == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.num_free_blocks == 2


def test_double_free_is_an_error():
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks)


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.allocate(1)
    assert blocks is not None
    h = hash_block(None, [1], b"")
    pool.cache(blocks[0], h)
    assert pool.lookup(h) is None


def test_hash_chain_depends_on_parent_tokens_and_extra_key():
    h0 = hash_block(None, [1, 2], b"a")
    assert h0 == hash_block(None, [1, 2], b"a")
    assert h0 != hash_block(None, [1, 2], b"b")
    assert h0 != hash_block(None, [2, 1], b"a")
    assert hash_block(h0, [3], b"a") != hash_block(None, [3], b"a")
