# mypy: disable-error-code="no-untyped-def"
"""Triton ``store_kv``: scatter each new token's keys and values into its cache slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import cache_strides, next_power_of_two


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


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write each token's key and value into its cache slot, in place (one program a token)."""
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
