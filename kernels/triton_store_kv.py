# mypy: disable-error-code="no-untyped-def"
"""Triton ``store_kv``: scatter each new token's keys and values into its cache slot.

An int8 cache (:mod:`kernels.int8_kv_cache`) is written by its rules, whose tokens of one
block depend on each other (a later token may grow the scale and requantize the earlier
ones). So one program takes a (run, KV head): a run is the consecutive slots of one block
written by this call, and only the program of its first token works; it keeps the block's
rows of its head in registers, adds the run's tokens one by one, and stores the rows and the
scale once. ``rint`` is the float32 magic-number rounding (``(x + 1.5 * 2^23) - 1.5 * 2^23``,
round half to even for ``|x| < 2^22``), which the interpreter runs too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int8_kv_cache import QUANT_MAX, SCALE_GROWTH, block_size_of
from kernels.triton_launch import cache_strides, next_power_of_two, scale_views

_RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23
_QUANT_MAX = tl.constexpr(QUANT_MAX)
_SCALE_GROWTH = tl.constexpr(SCALE_GROWTH)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    dst = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_token
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )  # [HEADS_PAD, HEAD_DIM]
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rint(x):
    return (x + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def _quantize_run(
    rows_ptr,  # this head's row of the run's first token
    stride_row_token,
    cache_ptr,  # this head's row 0 of the block
    scale_ptr,  # this head's float32 scale
    first_offset,
    run,
    stride_cache_token,
    HEAD_DIM: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK_PAD)
    dims = tl.arange(0, HEAD_DIM)
    tile_ptrs = cache_ptr + offsets[:, None] * stride_cache_token + dims[None, :]
    tile = tl.load(tile_ptrs, mask=(offsets < first_offset)[:, None], other=0).to(tl.float32)
    scale = tl.load(scale_ptr)
    max_q = tl.full([], _QUANT_MAX, tl.float32)
    one = tl.full([], 1.0, tl.float32)
    for i in range(run):
        offset = first_offset + i
        x = tl.load(rows_ptr + i * stride_row_token + dims).to(tl.float32)  # [HEAD_DIM]
        amax = tl.max(tl.abs(x), 0)
        fresh = tl.math.div_rn(amax, max_q)
        grow = (offset > 0) & (amax > scale * max_q)
        new = tl.where(grow, tl.maximum(fresh, scale * _SCALE_GROWTH), scale)
        new = tl.where(offset == 0, fresh, new)
        ratio = tl.math.div_rn(scale, tl.where(grow, new, one))
        tile = tl.where(grow, _rint(tile * ratio), tile)
        q = _rint(tl.math.div_rn(x, tl.where(new > 0, new, one)))
        q = tl.where(new > 0, tl.minimum(tl.maximum(q, -max_q), max_q), 0.0)
        tile = tl.where((offsets == offset)[:, None], q[None, :], tile)
        scale = new
    tl.store(tile_ptrs, tile.to(tl.int8), mask=(offsets < first_offset + run)[:, None])
    tl.store(scale_ptr, scale)


@triton.jit
def _store_kv_int8_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size + 1, num_kv_heads, head_dim] int8
    value_cache_ptr,
    key_scales_ptr,  # the caches as float32
    value_scales_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    num_tokens,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    previous = tl.load(slot_mapping_ptr + token - 1, mask=token > 0, other=-2).to(tl.int64)
    offset = slot % BLOCK_SIZE
    if (slot < 0) | ((offset > 0) & (previous == slot - 1)):
        return  # a skipped token, or one inside a run another program writes
    # The run: this token and the next ones while they fill the block's next slots.
    ahead = tl.arange(0, BLOCK_PAD)
    later = tl.load(slot_mapping_ptr + token + ahead, mask=token + ahead < num_tokens, other=-2).to(
        tl.int64
    )
    is_run = (later == slot + ahead) & (offset + ahead < BLOCK_SIZE)
    run = tl.min(tl.where(is_run, BLOCK_PAD, ahead), 0)
    block = slot // BLOCK_SIZE
    block_start = block * stride_cache_block + kv_head * stride_cache_head
    scale_index = (block * stride_cache_block + BLOCK_SIZE * stride_cache_token) // 4 + kv_head
    _quantize_run(
        key_ptr + token * stride_key_token + kv_head * stride_key_head,
        stride_key_token,
        key_cache_ptr + block_start,
        key_scales_ptr + scale_index,
        offset,
        run,
        stride_cache_token,
        HEAD_DIM,
        BLOCK_PAD,
    )
    _quantize_run(
        value_ptr + token * stride_value_token + kv_head * stride_value_head,
        stride_value_token,
        value_cache_ptr + block_start,
        value_scales_ptr + scale_index,
        offset,
        run,
        stride_cache_token,
        HEAD_DIM,
        BLOCK_PAD,
    )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write each token's key and value into its cache slot, in place (one program a token;
    an int8 cache's: one program a run of a block's slots and KV head, see the module)."""
    strides = cache_strides(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.shape != value.shape or tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"[num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}]"
        )
    if num_tokens == 0:
        return
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    if key_cache.dtype == torch.int8:
        block_size = block_size_of(key_cache)
        _store_kv_int8_kernel[(num_tokens, num_kv_heads)](
            key,
            value,
            key_cache,
            value_cache,
            *scale_views(key_cache, value_cache),
            slot_mapping,
            num_tokens,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            strides.block,
            strides.token,
            strides.head,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_PAD=next_power_of_two(block_size),
        )
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        strides.block,
        strides.token,
        strides.head,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_two(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
    )
