"""``KVCacheManager``'s speculative side: lookahead slots for draft tokens (never cached) and
``trim``, which hands back the blocks only rejected drafts took."""

from __future__ import annotations

from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request
from backend_engine.sampling_params import SamplingParams
from engine_protocol.block_hash import hash_block

BLOCK_SIZE = 4


def decoding_request(kv: KVCacheManager, rid: str = "a", num_prompt: int = 6) -> Request:
    """A request whose prompt is computed and which has sampled one token (left to compute)."""
    request = Request(
        rid, list(range(100, 100 + num_prompt)), SamplingParams(), max_tokens=16, arrival_seq=0
    )
    assert kv.allocate_slots(request, num_prompt) is not None
    request.num_computed_tokens = num_prompt
    request.all_token_ids.append(7)
    return request


def test_lookahead_slots_come_after_the_new_tokens() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = decoding_request(kv)  # 6 computed in blocks 0 and 1, token 7 to compute
    allocation = kv.allocate_slots(request, 1, num_lookahead_tokens=5)  # positions 6 to 11
    assert allocation is not None
    assert allocation.new_block_ids == (2,)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 7


def test_lookahead_tokens_register_no_block() -> None:
    """Block 1 (positions 4 to 7) is full only with the drafts at 7: it stays uncached."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = decoding_request(kv)
    first = hash_block(None, request.all_token_ids[:4], b"")
    assert kv.pool.cached_hashes == {first}
    assert kv.allocate_slots(request, 1, num_lookahead_tokens=5) is not None
    assert kv.pool.cached_hashes == {first}
    assert [kv.pool.blocks[i].block_hash for i in kv.block_table("a")] == [first, None, None]


def test_verified_tokens_are_cached_by_the_next_allocation() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = decoding_request(kv)
    assert kv.allocate_slots(request, 1, num_lookahead_tokens=3) is not None
    # Two drafts kept (positions 7 and 8), then the target's own token at 9.
    request.all_token_ids += [8, 9, 10]
    request.num_computed_tokens = 9
    kv.trim(request, request.num_computed_tokens)
    assert kv.allocate_slots(request, 1) is not None
    tokens = request.all_token_ids
    first = hash_block(None, tokens[:4], b"")
    second = hash_block(first, tokens[4:8], b"")
    assert kv.pool.cached_hashes == {first, second}


def test_lookahead_respects_the_reserved_blocks_and_changes_nothing_when_refused() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = decoding_request(kv)  # blocks 0 and 1; 2 free
    assert kv.allocate_slots(request, 1, num_reserved_blocks=1, num_lookahead_tokens=6) is None
    assert kv.block_table("a") == [0, 1]
    assert kv.num_free_blocks == 2
    allocation = kv.allocate_slots(request, 1, num_reserved_blocks=1, num_lookahead_tokens=5)
    assert allocation is not None
    assert allocation.new_block_ids == (2,)
    assert kv.num_free_blocks == 1


def test_trim_frees_the_blocks_past_the_kept_tokens_tail_first() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = decoding_request(kv)
    assert kv.allocate_slots(request, 1, num_lookahead_tokens=9) is not None  # to position 15
    assert kv.block_table("a") == [0, 1, 2, 3]
    kv.trim(request, 7)  # the last token computed, every draft rejected
    assert kv.block_table("a") == [0, 1]
    assert kv.num_free_blocks == 8
    # Freed tail first: block 3 joins the free list before block 2.
    other = Request("b", list(range(200, 224)), SamplingParams(), max_tokens=4, arrival_seq=1)
    allocation = kv.allocate_slots(other, 24)
    assert allocation is not None
    assert allocation.new_block_ids == (4, 5, 6, 7, 8, 9)
    last = kv.allocate_slots(request, 1, num_lookahead_tokens=5)
    assert last is not None
    assert last.new_block_ids == (3,)


def test_trim_keeps_a_block_that_holds_a_kept_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = decoding_request(kv)
    assert kv.allocate_slots(request, 1, num_lookahead_tokens=9) is not None
    kv.trim(request, 9)  # positions 0 to 8 kept: block 2 holds position 8
    assert kv.block_table("a") == [0, 1, 2]
    kv.trim(request, 8)  # exactly two blocks
    assert kv.block_table("a") == [0, 1]


def test_trim_with_nothing_past_the_tokens_is_a_no_op() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = decoding_request(kv)
    kv.trim(request, 7)
    kv.trim(request, 100)
    assert kv.block_table("a") == [0, 1]
    kv.trim(Request("unknown", [1], SamplingParams(), max_tokens=1, arrival_seq=1), 0)
    assert kv.num_free_blocks == 8
