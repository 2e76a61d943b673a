"""Shape checks and launch constants shared by the Triton paged-attention kernels.

Every kernel reads the KV cache the same way: a token at position ``pos`` of sequence ``s``
lives at ``block_tables[s, pos // block_size]``, row ``pos % block_size``. The element offset
is computed in int64 (a block id times the block stride overflows int32 on large pools)::

    block_id * stride_block + (pos % block_size) * stride_token + kv_head * stride_head + d
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int8_kv_cache import check_head_dim as check_int8_head_dim

# The smallest head_dim ``tl.dot`` accepts as its reduction dimension.
MIN_HEAD_DIM = 16


@dataclass(frozen=True)
class CacheStrides:
    """Element strides of a ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache."""

    block: int
    token: int
    head: int


def check_head_dim(head_dim: int) -> None:
    if head_dim < MIN_HEAD_DIM or head_dim & (head_dim - 1):
        raise ValueError(
            f"the Triton kernels need head_dim to be a power of two >= {MIN_HEAD_DIM}, "
            f"got {head_dim}"
        )


def cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> CacheStrides:
    """Validate the cache pair and return the strides both share."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError("key_cache and value_cache must share strides with a contiguous head_dim")
    check_head_dim(int(key_cache.shape[3]))
    return CacheStrides(key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))


def scale_views(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as float32, where an int8 cache's kernels read its block scales
    (:mod:`kernels.int8_kv_cache`); a float cache passes itself (the kernels ignore it)."""
    if key_cache.dtype != torch.int8:
        return key_cache, value_cache
    check_int8_head_dim(int(key_cache.shape[3]))
    return key_cache.view(torch.float32), value_cache.view(torch.float32)


def check_query(q: torch.Tensor, key_cache: torch.Tensor) -> int:
    """The number of query heads per KV head (the GQA group size)."""
    num_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    num_kv_heads = int(key_cache.shape[2])
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"q has head_dim {head_dim}, the cache {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    return num_heads // num_kv_heads


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s input precision: exact fp32 products for fp32 (no TF32 rounding), the
    target's default (tensor cores) for fp16/bf16."""
    return "ieee" if dtype == torch.float32 else None


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
