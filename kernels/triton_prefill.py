# mypy: disable-error-code="no-untyped-def"
"""Triton paged prefill attention: flash attention over a packed batch of chunks.

Sequence ``i`` contributes ``query_len_i`` new tokens, the last ones of its ``seq_len_i``
context; token ``j`` sits at position ``seq_len_i - query_len_i + j`` and sees every key up
to and including that position (the cached prefix and, causally, the chunk itself; its own
keys are stored before the call).

The query heads that share a KV head are folded into the tile's rows, so each program reads
its K/V tiles once for the whole GQA group::

    grid = (row tiles, num_kv_heads, num_seqs)
    row r of a tile  ->  token r // group, query head kv_head * group + r % group

    keys      0 ........ prefix_len ........ seq_len
    token j   |<------ all visible ------>|<- causal ->|

Each program runs an online softmax (base 2) over key tiles gathered through the block
table, up to the last key its last row can see. An int8 cache is read as stored, its block
scales applied to the scores and the probabilities (as in :mod:`kernels.triton_decode`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.int8_kv_cache import block_size_of
from kernels.triton_launch import cache_strides, check_query, dot_precision, scale_views
from kernels.triton_paging import cache_offsets, scale_offsets


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size (+ 1 if int8), num_kv_heads, head_dim]
    value_cache_ptr,
    key_scales_ptr,  # the key cache as float32 (int8 caches: their scale rows)
    value_scales_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= query_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = rows // GROUP  # [BLOCK_M], index within the chunk
    heads = kv_head * GROUP + rows % GROUP
    is_row = tokens < query_len
    # Padding rows see every key, so their softmax stays finite; they are never stored.
    query_pos = tl.where(is_row, prefix_len + tokens, seq_len)
    dims = tl.arange(0, HEAD_DIM)
    token_index = (q_start + tokens).to(tl.int64)
    q = tl.load(
        q_ptr
        + token_index[:, None] * stride_q_token
        + heads[:, None] * stride_q_head
        + dims[None, :],
        mask=is_row[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_token = tl.minimum(((tile + 1) * BLOCK_M - 1) // GROUP, query_len - 1)
    kv_end = prefix_len + last_token + 1
    table_row = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        is_key = pos < kv_end
        offsets = cache_offsets(
            table_row,
            pos,
            is_key,
            kv_head,
            stride_cache_block,
            stride_cache_token,
            stride_cache_head,
            BLOCK_SIZE,
        )  # [BLOCK_N]
        k = tl.load(
            key_cache_ptr + offsets[:, None] + dims[None, :], mask=is_key[:, None], other=0.0
        )  # [BLOCK_N, HEAD_DIM]
        if IS_INT8:  # widen through float32 (exact; Triton's interpreter casts int8 -> bf16 wrong)
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if IS_INT8:  # an int8 block's values times its scale: fold the key scales in here
            scales = scale_offsets(
                table_row, pos, is_key, kv_head, stride_cache_block, stride_cache_token, BLOCK_SIZE
            )  # [BLOCK_N]
            scores = scores * tl.load(key_scales_ptr + scales, mask=is_key, other=0.0)[None, :]
        is_visible = is_key[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(is_visible, scores * scale_log2, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + offsets[:, None] + dims[None, :], mask=is_key[:, None], other=0.0
        )  # [BLOCK_N, HEAD_DIM]
        if IS_INT8:
            v = v.to(tl.float32)
        if IS_INT8:  # ... and the value scales into the probabilities
            p_v = p * tl.load(value_scales_ptr + scales, mask=is_key, other=0.0)[None, :]
        else:
            p_v = p
        acc = acc * alpha[:, None] + tl.dot(
            p_v.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr
        + token_index[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=is_row[:, None],
    )


def _launch_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps), sized from sm_90 ptxas register reports: 64x64 tiles
    with 4 warps (8 at head_dim 128) compile without spills for fp16/bf16; fp32 (the exact
    path, not the fast one) halves the key tile."""
    if dtype == torch.float32:
        return 64, 32, 8
    return 64, 64, 4 if head_dim <= 64 else 8


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's tokens in q
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new tokens
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Chunks of new tokens: sequence i's tokens are the last ``query_len_i`` of its context."""
    strides = cache_strides(key_cache, value_cache)
    group = check_query(q, key_cache)
    num_tokens, _, head_dim = q.shape
    out = torch.empty_like(q)
    num_seqs = int(seq_lens.shape[0])
    if num_seqs == 0 or num_tokens == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    # The one host sync: the grid needs the longest chunk.
    max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m, block_n, num_warps = _launch_config(head_dim, q.dtype)
    num_kv_heads = int(key_cache.shape[2])
    grid = (triton.cdiv(max_query_len * group, block_m), num_kv_heads, num_seqs)
    _prefill_kernel[grid](
        q,
        key_cache,
        value_cache,
        *scale_views(key_cache, value_cache),
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        strides.block,
        strides.token,
        strides.head,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size_of(key_cache),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IS_INT8=key_cache.dtype == torch.int8,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )
    return out
