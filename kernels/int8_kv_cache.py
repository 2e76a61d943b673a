"""The int8 KV cache: its layout, the quantizing store (the reference) and dequantization.

Layout. An int8 cache is one ``torch.int8`` tensor per K and per V, like a float cache but
with one more token row per block, which holds the block's scales::

    cache: [num_blocks, block_size + 1, num_kv_heads, head_dim] int8
           rows 0..block_size-1: the tokens' values, value = q * scale[block, head]
           row block_size:       num_kv_heads float32 scales in its first 4 * num_kv_heads
                                 bytes (the rest unused)

Keeping the scales inside their block leaves every kernel signature and the engine's
``KVCache = (key_cache, value_cache)`` as they are: kernels dispatch on
``cache.dtype == torch.int8``, and a block copy (prefix-cache forks, copy-on-write) copies
the scales with the values. The block size of any cache is :func:`block_size_of`. The scale
row needs ``head_dim % 4 == 0`` (so it holds the floats and they are aligned). A block
costs ``(block_size + 1) * num_kv_heads * head_dim`` bytes: 3.76x fewer than float32 at 16
tokens a block.

Writing. Tokens arrive one at a time, so a block's scale is fixed before its later tokens
are known. Per (block, KV head), in slot order:

* the block's first slot (``slot % block_size == 0``) sets ``scale = amax / 127`` from that
  token alone (``amax`` = the head's largest ``|x|``), whatever stale scale a freed and
  reused block held;
* a later token with ``amax > 127 * scale`` grows it to ``max(amax / 127, 1.25 * scale)``,
  and the values already in the block are requantized: ``q = rint(q * (old / new))``;
* then ``q = clamp(rint(x / scale), -127, 127)`` (``rint``: round half to even).

This is correct with prefix caching because a block is written from slot 0 upward and a
cached (full) block is never written again; a copied partial block carries its scale. A
call may write several tokens of one block; they must be consecutive slots in token order
(the engine's are), and the result is the same as writing them one call at a time.

Error bound. A value first quantized against scale ``s0`` and requantized as the scale grew
to ``s1 < ... < sk`` (each >= 1.25x the one before) is off by at most
``0.5 * (s0 + ... + sk) <= 0.5 * sk * 1.25 / 0.25 = 2.5 * sk``; and ``sk <= 1.25 * M / 127``
for the head's largest ``|x|`` M in the block. So ``|x - x_hat| <= 2.5 * sk <= 3.2 % * M``
in the worst case (growths every token), and ``0.5 * M / 127 = 0.39 % * M`` for a block
whose scale never grows (the usual case: a head's largest channels are the same from token
to token). Growing by at least 1.25x bounds the pile-up of requantization errors to that
geometric sum.

Every implementation (this reference in PyTorch, ``kernels/csrc/paged_attention.h``'s
``store_token_int8`` and the Triton store) follows these rules in float32 arithmetic.
"""

from __future__ import annotations

import torch

QUANT_MAX = 127.0
SCALE_GROWTH = 1.25  # the least factor a block's scale grows by


def block_size_of(cache: torch.Tensor) -> int:
    """Tokens per block of a ``[num_blocks, rows, num_kv_heads, head_dim]`` cache."""
    return int(cache.shape[1]) - 1 if cache.dtype == torch.int8 else int(cache.shape[1])


def check_head_dim(head_dim: int) -> None:
    if head_dim < 4 or head_dim % 4:
        raise ValueError(
            f"an int8 KV cache needs head_dim to be a multiple of 4 (its block scales are "
            f"float32 in a token row), got {head_dim}"
        )


def int8_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    check_head_dim(head_dim)
    return (num_blocks, block_size + 1, num_kv_heads, head_dim)


def int8_bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one K or V cache, its scale row included."""
    return (block_size + 1) * num_kv_heads * head_dim


def block_scales(cache: torch.Tensor) -> torch.Tensor:  # [num_blocks, num_kv_heads] float32
    """A writable float32 view of every block's scales."""
    num_blocks, rows, num_kv_heads, head_dim = cache.shape
    scale_rows = cache[:, rows - 1].reshape(num_blocks, num_kv_heads * head_dim)
    return scale_rows[:, : 4 * num_kv_heads].view(torch.float32)


def dequantize_blocks(
    blocks: torch.Tensor,  # [n, block_size + 1, num_kv_heads, head_dim] int8
) -> torch.Tensor:  # [n, block_size, num_kv_heads, head_dim] float32
    values = blocks[:, :-1].to(torch.float32)
    return values * block_scales(blocks)[:, None, :, None]


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, rows, num_kv_heads, head_dim], any dtype
    block_ids: torch.Tensor,  # [n] int
) -> torch.Tensor:  # [n * block_size, num_kv_heads, head_dim], float32 for an int8 cache
    """The tokens of ``block_ids``, in order (an int8 cache's dequantized)."""
    _, _, num_kv_heads, head_dim = cache.shape
    if cache.dtype == torch.int8:
        blocks = dequantize_blocks(cache.index_select(0, block_ids.to(torch.int64)))
        return blocks.view(-1, num_kv_heads, head_dim)
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    return rows.view(-1, num_kv_heads, head_dim)


def store_quantized(
    rows: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] float
    cache: torch.Tensor,  # [num_blocks, block_size + 1, num_kv_heads, head_dim] int8
    slots: torch.Tensor,  # [num_tokens] int64, all >= 0
) -> None:
    """Quantize each token into its slot, in place, by the module's rules.

    Vectorised over blocks: step ``o`` writes every token whose slot is at offset ``o`` of
    its block (one token per block, as slots are distinct), so a block's tokens go in in
    slot order."""
    block_size = block_size_of(cache)
    if slots.numel() == 0:
        return
    scales = block_scales(cache)  # [num_blocks, num_kv_heads]
    values = rows.to(torch.float32)
    blocks, offsets = slots // block_size, slots % block_size
    for offset in sorted(set(offsets.tolist())):
        picked = (offsets == offset).nonzero().squeeze(1)
        block = blocks.index_select(0, picked)  # [n]
        x = values.index_select(0, picked)  # [n, kv, d]
        amax = x.abs().amax(dim=-1)  # [n, kv]
        if offset == 0:
            scale = amax / QUANT_MAX
        else:
            old = scales.index_select(0, block)
            grow = amax > old * QUANT_MAX
            scale = torch.where(grow, torch.maximum(amax / QUANT_MAX, old * SCALE_GROWTH), old)
            if bool(grow.any()):
                ratio = torch.where(grow, old / torch.where(grow, scale, 1.0), 1.0)
                earlier = cache[block, :offset].to(torch.float32)  # [n, offset, kv, d]
                cache[block, :offset] = torch.round(earlier * ratio[:, None, :, None]).to(
                    torch.int8
                )
        safe_scale = torch.where(scale > 0, scale, 1.0)[..., None]
        q = torch.round(x / safe_scale).clamp(-QUANT_MAX, QUANT_MAX)
        cache[block, offset] = torch.where(scale[..., None] > 0, q, 0.0).to(torch.int8)
        scales[block] = scale
