"""The fast reference kernels against deliberately naive per-token versions."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import cpu_attention, dispatch, reference

# Tolerances: fp32 differs only by summation order; bf16 inputs are computed in float32 by
# both sides, so the gap is the final rounding to bf16 (~2^-8 relative).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


# ---------------------------------------------------------------- naive reference


def naive_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    rows = []
    for pos in range(seq_len):
        block = int(block_table[pos // block_size])
        rows.append(cache[block, pos % block_size])
    return torch.stack(rows).float()  # [seq_len, num_kv_heads, head_dim]


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: list[int], scale: float
) -> torch.Tensor:
    # q [n, H, D], k/v [L, Hkv, D]; query i sees keys 0..query_pos[i]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale  # [H, n, L]
    allowed = torch.arange(k.shape[0])[None, :] <= torch.tensor(query_pos)[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.einsum("hnl,lhd->nhd", probs, v)  # [n, H, D] float32


def naive_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    outs = []
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = naive_gather(key_cache, block_tables[i], seq_len)
        v = naive_gather(value_cache, block_tables[i], seq_len)
        outs.append(naive_attention(q[i : i + 1], k, v, [seq_len - 1], scale))
    return torch.cat(outs).to(q.dtype)


def naive_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    outs = []
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k = naive_gather(key_cache, block_tables[i], seq_len)
        v = naive_gather(value_cache, block_tables[i], seq_len)
        positions = [seq_len - (end - start) + j for j in range(end - start)]
        outs.append(naive_attention(q[start:end], k, v, positions, scale))
    return torch.cat(outs).to(q.dtype)


# ---------------------------------------------------------------- helpers


def make_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def random_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Distinct, shuffled blocks from a large pool, padded with garbage ids."""
    needed = [-(-n // block_size) for n in seq_lens]
    width = max(needed) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    return table


GRID = [
    (group, head_dim, block_size)
    for group in (1, 4, 7)
    for head_dim in (64, 128)
    for block_size in (16, 32)
]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), GRID)
def test_decode_matches_naive(
    group: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    torch.manual_seed(group + head_dim)
    num_kv_heads = 2
    seq_lens = [1, 7, block_size, block_size + 1, 3 * block_size - 5, 300, 41, 2]
    key_cache, value_cache = make_cache(200, block_size, num_kv_heads, head_dim, dtype)
    tables = random_block_tables(seq_lens, block_size, 200, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)

    out = reference.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale)
    expected = naive_decode(q, key_cache, value_cache, tables, lens, scale)
    assert out.dtype == dtype
    assert out.shape == q.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), GRID)
def test_prefill_matches_naive(
    group: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size + 1)
    torch.manual_seed(group + head_dim + 1)
    num_kv_heads = 2
    # (context length, new tokens): fresh prompts, chunks after a cached prefix, 1-token chunks
    cases = [(1, 1), (37, 37), (70, 10), (block_size, 1), (2 * block_size + 3, block_size), (5, 3)]
    seq_lens = [n for n, _ in cases]
    query_lens = [qn for _, qn in cases]
    key_cache, value_cache = make_cache(200, block_size, num_kv_heads, head_dim, dtype)
    tables = random_block_tables(seq_lens, block_size, 200, gen)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim).to(dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)

    out = reference.paged_prefill_attention(q, key_cache, value_cache, tables, cu, lens, scale)
    expected = naive_prefill(q, key_cache, value_cache, tables, cu, lens, scale)
    assert out.dtype == dtype
    assert out.shape == q.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("seq_len", [1, 16, 50])
def test_prefill_single_full_prompt(seq_len: int) -> None:
    """The no-mask (plain causal) fast path."""
    gen = torch.Generator().manual_seed(seq_len)
    key_cache, value_cache = make_cache(64, 16, 2, 64, torch.float32)
    tables = random_block_tables([seq_len], 16, 64, gen)
    q = torch.randn(seq_len, 8, 64)
    cu = torch.tensor([0, seq_len], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    out = reference.paged_prefill_attention(q, key_cache, value_cache, tables, cu, lens, 0.125)
    expected = naive_prefill(q, key_cache, value_cache, tables, cu, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens", [[20, 30, 25], [30, 20, 25, 1000, 3], [5, 5, 700]])
def test_unsorted_lengths_in_one_or_several_buckets(seq_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    key_cache, value_cache = make_cache(256, 16, 2, 64, torch.float32)
    tables = random_block_tables(seq_lens, 16, 256, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), 8, 64)
    out = reference.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)
    expected = naive_decode(q, key_cache, value_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    query_lens = [min(n, 9) for n in seq_lens]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(query_lens), 8, 64)
    out = reference.paged_prefill_attention(q, key_cache, value_cache, tables, cu, lens, 0.125)
    expected = naive_prefill(q, key_cache, value_cache, tables, cu, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_equal_lengths_and_empty_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = make_cache(64, 16, 2, 64, torch.float32)
    tables = random_block_tables([32, 32, 32], 16, 64, gen)
    q = torch.randn(3, 4, 64)
    lens = torch.tensor([32, 32, 32], dtype=torch.int32)
    out = reference.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)
    expected = naive_decode(q, key_cache, value_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    empty = reference.paged_decode_attention(
        q[:0], key_cache, value_cache, tables[:0], lens[:0], 0.125
    )
    assert empty.shape == (0, 4, 64)


def test_store_kv_writes_slots_and_skips_negative() -> None:
    key_cache = torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(3, 2, 16)
    value = torch.randn(3, 2, 16)
    slots = torch.tensor([3 * 8 + 5, -1, 0 * 8 + 7], dtype=torch.int64)
    reference.store_kv(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache[3, 5], key[0].bfloat16())
    torch.testing.assert_close(value_cache[0, 7], value[2].bfloat16())
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 2  # nothing else written


def test_public_api_dispatches_to_cpu_kernels_on_cpu() -> None:
    assert dispatch.implementation_for(is_cuda=False) is cpu_attention
    key_cache, value_cache = make_cache(8, 16, 1, 32, torch.float32)
    key, value = torch.randn(5, 1, 32), torch.randn(5, 1, 32)
    slots = torch.arange(5, dtype=torch.int64) + 16  # block 1
    kernels.store_kv(key, value, key_cache, value_cache, slots)
    tables = torch.tensor([[1]], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    q = torch.randn(5, 2, 32)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    prefill = kernels.paged_prefill_attention(q, key_cache, value_cache, tables, cu, lens, 0.2)
    decode = kernels.paged_decode_attention(q[-1:], key_cache, value_cache, tables, lens, 0.2)
    torch.testing.assert_close(prefill[-1:], decode, atol=1e-6, rtol=1e-6)
