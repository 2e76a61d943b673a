"""Paged-attention kernels in plain PyTorch: the CPU path and the ground truth for GPU kernels.

KV cache layout (one pair per layer)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:           [num_seqs, max_blocks_per_seq] int32 (block ids)
    slot_mapping:           [num_tokens] int64, slot = block_id * block_size + offset, -1 = skip

An int8 cache (:mod:`kernels.int8_kv_cache`: one more row per block holding its scales) is
quantized on store and its gathered blocks dequantized on read, then the same float path runs.

Attention gathers whole blocks with ``index_select`` (much faster than advanced indexing on
CPU), pads sequences of similar length into a batch, and runs one
``scaled_dot_product_attention`` per batch with grouped query heads folded into the query
axis::

    q [b, q_len, kv_heads * group, d]  ->  [b, kv_heads, group * q_len, d]
    k [b, kv_heads, ctx_len, d]           (shared by the whole group, never repeated)

Sequences are sorted by context length and split into buckets whenever the length halves, so
a batch mixing 20- and 2000-token contexts does not pad everything to 2000.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int8_kv_cache import block_size_of, gather_blocks, store_quantized

# A new bucket starts when a sequence's context is shorter than this fraction of the
# bucket's longest context: padding then wastes at most half of each bucket's work.
_BUCKET_RATIO = 0.5


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write each token's key and value into its cache slot, in place (an int8 cache's
    quantized, :func:`kernels.int8_kv_cache.store_quantized`)."""
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if key_cache.dtype == torch.int8:
        num_slots = key_cache.shape[0] * block_size_of(key_cache)
        if slots.numel() and int(slots.max()) >= num_slots:
            raise IndexError(f"a slot lies outside the cache's {num_slots} slots")
        store_quantized(key, key_cache, slots)
        store_quantized(value, value_cache, slots)
        return
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    flat_key_cache = key_cache.view(num_slots, *key_cache.shape[2:])
    flat_value_cache = value_cache.view(num_slots, *value_cache.shape[2:])
    flat_key_cache.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_value_cache.index_copy_(0, slots, value.to(value_cache.dtype))


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the query token
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence, attending to its whole context (the last one is itself)."""
    num_seqs = q.shape[0]
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    lens = seq_lens.tolist()
    for rows in _buckets(lens, [1] * num_seqs):
        is_whole_batch = rows == list(range(num_seqs))
        idx = torch.tensor(rows, dtype=torch.int64, device=q.device)
        bucket_lens = [lens[r] for r in rows]
        q_bucket = q if is_whole_batch else q.index_select(0, idx)
        tables = block_tables if is_whole_batch else block_tables.index_select(0, idx)
        res = _padded_attention(
            q_bucket.unsqueeze(1),  # [b, 1, num_heads, head_dim]
            key_cache,
            value_cache,
            tables,
            bucket_lens,
            [1] * len(rows),
            scale,
        )  # [b, 1, num_heads, head_dim]
        if is_whole_batch:
            out.copy_(res.squeeze(1))
        else:
            out.index_copy_(0, idx, res.squeeze(1).to(out.dtype))
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's tokens in q
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new tokens
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Chunks of new tokens: sequence i's tokens are the last ``query_len_i`` of its context.

    Each new token attends to the cached prefix (read through the block table, so the chunk's
    own keys must already be stored) and causally to the new tokens before it.
    """
    out = torch.empty_like(q)
    num_seqs = int(seq_lens.shape[0])
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    query_lens = [cu[i + 1] - cu[i] for i in range(num_seqs)]
    # Sequences with no cached prefix need only causal masking, which SDPA does without
    # an explicit mask (and skips the upper triangle), so keep them apart from the rest.
    whole = [i for i in range(num_seqs) if query_lens[i] == lens[i]]
    continued = [i for i in range(num_seqs) if query_lens[i] != lens[i]]
    groups = [
        [part[i] for i in rows]
        for part in (whole, continued)
        if part
        for rows in _buckets([lens[i] for i in part], [query_lens[i] for i in part])
    ]
    for rows in groups:
        bucket_lens = [lens[r] for r in rows]
        bucket_qlens = [query_lens[r] for r in rows]
        max_q = max(bucket_qlens)
        # [b, max_q] token index of each padded query row (padding repeats the last token)
        offsets = torch.arange(max_q, dtype=torch.int64)
        starts = torch.tensor([cu[r] for r in rows], dtype=torch.int64)
        qlens_t = torch.tensor(bucket_qlens, dtype=torch.int64)
        token_idx = starts[:, None] + torch.minimum(offsets[None, :], qlens_t[:, None] - 1)
        is_real = offsets[None, :] < qlens_t[:, None]  # [b, max_q]
        token_idx, is_real = token_idx.to(q.device), is_real.to(q.device)
        q_bucket = q.index_select(0, token_idx.view(-1)).view(len(rows), max_q, *q.shape[1:])
        idx = torch.tensor(rows, dtype=torch.int64, device=q.device)
        is_whole_batch = rows == list(range(num_seqs))
        tables = block_tables if is_whole_batch else block_tables.index_select(0, idx)
        res = _padded_attention(
            q_bucket, key_cache, value_cache, tables, bucket_lens, bucket_qlens, scale
        )  # [b, max_q, num_heads, head_dim]
        out.index_copy_(0, token_idx[is_real], res[is_real].to(out.dtype))
    return out


def _buckets(seq_lens: list[int], query_lens: list[int]) -> list[list[int]]:
    """Group sequence indices so each group pads to at most ~2x its real work."""
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], -query_lens[i]))
    groups: list[list[int]] = []
    top_len = top_q = 0
    for i in order:
        if (
            not groups
            or seq_lens[i] < top_len * _BUCKET_RATIO
            or query_lens[i] < top_q * _BUCKET_RATIO
        ):
            groups.append([])
            top_len, top_q = seq_lens[i], query_lens[i]
        groups[-1].append(i)
        top_q = max(top_q, query_lens[i])
    return groups


def _padded_attention(
    q: torch.Tensor,  # [b, max_q, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [b, >= max_blocks] int32
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [b, max_q, num_heads, head_dim], float32 or q's dtype
    batch, max_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = block_size_of(key_cache), key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = max(seq_lens)
    max_blocks = -(-max_len // block_size)
    compute_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    block_ids = block_tables[:, :max_blocks].reshape(-1)
    k = _gather(key_cache, block_ids, batch, max_len, compute_dtype)  # [b, kv, max_len, d]
    v = _gather(value_cache, block_ids, batch, max_len, compute_dtype)  # [b, kv, max_len, d]

    mask = _attention_mask(seq_lens, query_lens, max_len, q.device)  # [b, max_q, max_len]
    if mask is None and max_q > 1:
        # Whole prompts: plain causal attention (folding the group into the query axis would
        # break ``is_causal``'s row alignment, so let SDPA broadcast the KV heads instead).
        qh = q.to(compute_dtype).transpose(1, 2)  # [b, num_heads, max_q, d]
        res = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return res.transpose(1, 2)
    # [b, kv, group * max_q, d]: the group's queries share one K/V read
    qg = (
        q.to(compute_dtype)
        .view(batch, max_q, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, num_kv_heads, group * max_q, head_dim)
    )
    if mask is None:
        res = F.scaled_dot_product_attention(qg, k, v, scale=scale)
    else:
        mask = mask[:, None, None].expand(batch, 1, group, max_q, max_len)
        mask = mask.reshape(batch, 1, group * max_q, max_len)
        res = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    # [b, kv, group * max_q, d] -> [b, max_q, num_heads, d]
    res = res.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return res.reshape(batch, max_q, num_heads, head_dim)


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size (+ 1 if int8), num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [b * max_blocks]
    batch: int,
    max_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [b, num_kv_heads, max_len, head_dim]
    _, _, num_kv_heads, head_dim = cache.shape
    blocks = gather_blocks(cache, block_ids)
    blocks = blocks.view(batch, -1, num_kv_heads, head_dim)[:, :max_len]
    return blocks.to(dtype).transpose(1, 2)


def _attention_mask(
    seq_lens: list[int], query_lens: list[int], max_len: int, device: torch.device
) -> torch.Tensor | None:
    """``True`` where query row j of sequence b may see key position p; ``None`` = plain causal.

    Query j sits at position ``seq_len - query_len + j``; padding rows (j >= query_len) see
    the whole context so their softmax stays finite (they are discarded anyway).
    """
    max_q = max(query_lens)
    if all(qn == n for qn, n in zip(query_lens, seq_lens, strict=True)):
        # No cached prefix anywhere: causal masking alone is exact for every real query
        # row (row j sees keys 0..j, all inside its own sequence); padding rows are dropped.
        return None
    if all(n == max_len for n in seq_lens) and all(qn == 1 for qn in query_lens):
        return None
    lens = torch.tensor(seq_lens, dtype=torch.int64)  # [b]
    qlens = torch.tensor(query_lens, dtype=torch.int64)  # [b]
    rows = torch.arange(max_q, dtype=torch.int64)  # [max_q]
    cols = torch.arange(max_len, dtype=torch.int64)  # [max_len]
    query_pos = (lens - qlens)[:, None] + rows[None, :]  # [b, max_q]
    query_pos = torch.where(rows[None, :] < qlens[:, None], query_pos, lens[:, None] - 1)
    mask = cols[None, None, :] <= query_pos[:, :, None]  # [b, max_q, max_len]
    return mask.to(device)
