# mypy: disable-error-code="no-untyped-def"
"""Device-side helpers shared by the Triton attention kernels: where a context position's
key and value (and, in an int8 cache, their block's scale) live in the paged cache."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cache_offsets(
    table_row,  # pointer to this sequence's row of the block table
    pos,  # [TILE] context positions
    is_key,  # [TILE] positions inside the context
    kv_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets of ``pos`` in a ``[num_blocks, block_size, kv_heads, head_dim]``
    cache, through the block table, in int64 so large pools do not overflow."""
    block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
    return (
        block_ids * stride_cache_block
        + (pos % BLOCK_SIZE).to(tl.int64) * stride_cache_token
        + kv_head * stride_cache_head
    )


@triton.jit
def scale_offsets(
    table_row,  # pointer to this sequence's row of the block table
    pos,  # [TILE] context positions
    is_key,  # [TILE] positions inside the context
    kv_head,
    stride_cache_block,
    stride_cache_token,
    BLOCK_SIZE: tl.constexpr,
):
    """Float32 offsets of ``pos``'s block scales in an int8 cache (see
    ``kernels/int8_kv_cache.py``): the block's last row holds one float per KV head."""
    block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
    return (block_ids * stride_cache_block + BLOCK_SIZE * stride_cache_token) // 4 + kv_head
