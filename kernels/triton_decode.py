# mypy: disable-error-code="no-untyped-def"
"""Triton paged decode attention, flash-decoding style.

One query token per sequence. The context is cut into partitions of ``partition_size``
tokens, and one program handles one (sequence, KV head, partition)::

    grid = (num_seqs, num_kv_heads, num_partitions)

    context  [---- p0 ----|---- p1 ----|-- p2 --]      partition_size tokens each
    program  (s, h, p): all query heads of KV head h (the GQA group, padded to >= 16 rows so
             the scores are one ``tl.dot``) against p's keys, read tile by tile through the
             block table; K and V are loaded once for the whole group
    partial  max logit m_p, exp-sum l_p and unnormalised output acc_p, in float32
    merge    out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p,   M = max_p m_p

By default the partition is 512 tokens, halved (down to 64) while the grid would give the GPU
fewer than ``_WAVES`` programs per SM, so small batches still spread over the whole device.
When every sequence fits in one partition the first kernel writes the output directly and
the merge kernel is skipped. The partition count is bounded by the block table's width, so
the launch needs no device-to-host sync (partitions past a sequence's end exit at once).
Logits are kept in base 2 (``scale * log2(e)`` folded into the scale) so softmax uses exp2.
An int8 cache (:mod:`kernels.int8_kv_cache`) is read as stored: a tile's keys are multiplied
in as integers and their block scales applied to the scores, and the value scales to the
probabilities, so nothing is dequantized in memory.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

from kernels.int8_kv_cache import block_size_of
from kernels.triton_launch import (
    cache_strides,
    check_query,
    dot_precision,
    next_power_of_two,
    scale_views,
)
from kernels.triton_paging import cache_offsets, scale_offsets

DEFAULT_PARTITION_SIZE = 512
_MIN_PARTITION_SIZE = 64
_WAVES = 4  # programs per SM the default partition size aims for
_TILE = 32  # keys per inner-loop step (gathered across cache blocks token by token)
_MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows
_MERGE_CHUNK = 32  # partitions merged per step


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size (+ 1 if int8), num_kv_heads, head_dim]
    value_cache_ptr,
    key_scales_ptr,  # the key cache as float32 (int8 caches: their scale rows)
    value_scales_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim], written when IS_SINGLE_PARTITION
    max_logits_ptr,  # [num_seqs, num_heads, num_partitions] float32
    exp_sums_ptr,  # [num_seqs, num_heads, num_partitions] float32
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] float32
    scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    IS_SINGLE_PARTITION: tl.constexpr,
    IS_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = partition * PARTITION_SIZE
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows  # [GROUP_PAD]
    is_head = rows < GROUP
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=is_head[:, None],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        is_key = pos < end
        offsets = cache_offsets(
            table_row,
            pos,
            is_key,
            kv_head,
            stride_cache_block,
            stride_cache_token,
            stride_cache_head,
            BLOCK_SIZE,
        )  # [TILE]
        k = tl.load(
            key_cache_ptr + offsets[:, None] + dims[None, :], mask=is_key[:, None], other=0.0
        )  # [TILE, HEAD_DIM]
        if IS_INT8:  # widen through float32 (exact; Triton's interpreter casts int8 -> bf16 wrong)
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if IS_INT8:  # an int8 block's values times its scale: fold the key scales in here
            scales = scale_offsets(
                table_row, pos, is_key, kv_head, stride_cache_block, stride_cache_token, BLOCK_SIZE
            )  # [TILE]
            scores = scores * tl.load(key_scales_ptr + scales, mask=is_key, other=0.0)[None, :]
        scores = tl.where(is_key[None, :], scores * scale_log2, float("-inf"))  # [GROUP_PAD, TILE]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + offsets[:, None] + dims[None, :], mask=is_key[:, None], other=0.0
        )  # [TILE, HEAD_DIM]
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

    if IS_SINGLE_PARTITION:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=is_head[:, None],
        )
    else:
        num_heads = tl.num_programs(1) * GROUP
        num_partitions = tl.num_programs(2)
        row = (seq * num_heads + heads) * num_partitions + partition  # [GROUP_PAD]
        tl.store(max_logits_ptr + row, m_i, mask=is_head)
        tl.store(exp_sums_ptr + row, l_i, mask=is_head)
        tl.store(
            partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=is_head[:, None]
        )


@triton.jit
def _decode_merge_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    max_logits_ptr,  # [num_seqs, num_heads, num_partitions] float32
    exp_sums_ptr,
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] float32
    seq_lens_ptr,
    stride_out_seq,
    stride_out_head,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, PARTITION_SIZE)
    row = (seq * tl.num_programs(1) + head) * num_partitions
    parts = tl.arange(0, CHUNK)
    dims = tl.arange(0, HEAD_DIM)

    global_max = tl.full([CHUNK], float("-inf"), tl.float32)
    for first in range(0, num_used, CHUNK):
        m = tl.load(max_logits_ptr + row + first + parts, mask=first + parts < num_used, other=0.0)
        m = tl.where(first + parts < num_used, m, float("-inf"))
        global_max = tl.maximum(global_max, m)
    m_max = tl.max(global_max, 0)

    total = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([CHUNK, HEAD_DIM], tl.float32)
    for first in range(0, num_used, CHUNK):
        is_used = first + parts < num_used
        m = tl.load(max_logits_ptr + row + first + parts, mask=is_used, other=0.0)
        exp_sum = tl.load(exp_sums_ptr + row + first + parts, mask=is_used, other=0.0)
        weight = tl.where(is_used, tl.exp2(m - m_max), 0.0)  # [CHUNK]
        total += weight * exp_sum
        partial = tl.load(
            partial_out_ptr + (row + first + parts)[:, None] * HEAD_DIM + dims[None, :],
            mask=is_used[:, None],
            other=0.0,
        )  # [CHUNK, HEAD_DIM]
        acc += partial * weight[:, None]
    out = tl.sum(acc, 0) / tl.sum(total, 0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
    )


def choose_partition_size(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int | None
) -> int:
    """512 tokens, halved while the grid has fewer than ``_WAVES`` programs per SM."""
    size = DEFAULT_PARTITION_SIZE
    if num_sms is None:
        return size
    while (
        size > _MIN_PARTITION_SIZE
        and num_seqs * num_kv_heads * triton.cdiv(max_context, size) < _WAVES * num_sms
    ):
        size //= 2
    return size


def _num_warps(dtype: torch.dtype) -> int:
    """4 warps for fp16/bf16; fp32 tiles need 8 to stay out of local memory (sm_90 ptxas:
    <= 230 registers, no spills, at head_dim 128)."""
    return 8 if dtype == torch.float32 else 4


@cache
def _num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the query token
    scale: float,
    *,
    partition_size: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its whole context (the last one is itself).

    ``partition_size`` (a power of two >= 16) is the number of keys one program reduces;
    ``None`` picks one from the batch shape (:func:`choose_partition_size`).
    """
    strides = cache_strides(key_cache, value_cache)
    group = check_query(q, key_cache)
    if partition_size is not None and (
        partition_size < 16 or partition_size & (partition_size - 1)
    ):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    block_size = block_size_of(key_cache)
    num_kv_heads = int(key_cache.shape[2])
    max_context = int(block_tables.shape[1]) * block_size  # a bound, known without a sync
    if partition_size is None:
        num_sms = _num_sms(q.device) if q.is_cuda else None
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_context, num_sms)
    num_partitions = max(triton.cdiv(max_context, partition_size), 1)
    is_single = num_partitions == 1
    partial_shape = (num_seqs, num_heads, num_partitions) if not is_single else (1, 1, 1)
    max_logits = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    exp_sums = torch.empty_like(max_logits)
    partial_out = torch.empty((*partial_shape, head_dim), dtype=torch.float32, device=q.device)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q,
        key_cache,
        value_cache,
        *scale_views(key_cache, value_cache),
        block_tables,
        seq_lens,
        out,
        max_logits,
        exp_sums,
        partial_out,
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
        GROUP_PAD=max(next_power_of_two(group), _MIN_GROUP_ROWS),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=partition_size,
        TILE=min(_TILE, partition_size),
        IS_SINGLE_PARTITION=is_single,
        IS_INT8=key_cache.dtype == torch.int8,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=_num_warps(q.dtype),
    )
    if not is_single:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out,
            max_logits,
            exp_sums,
            partial_out,
            seq_lens,
            out.stride(0),
            out.stride(1),
            num_partitions,
            HEAD_DIM=head_dim,
            PARTITION_SIZE=partition_size,
            CHUNK=min(next_power_of_two(num_partitions), _MERGE_CHUNK),
        )
    return out
