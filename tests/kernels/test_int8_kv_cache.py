"""The int8 KV cache: its store rules (a per-token loop as the referee), the reference and
the native CPU kernels reading and writing it."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, int8_kv_cache, reference
from kernels.cpu_build import find_compiler
from kernels.int8_kv_cache import block_scales, dequantize_blocks, int8_cache_shape
from tests.support.int8_kv_cases import grown_rows, random_int8_case, sequence_slots, stale_caches

needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")


def naive_store(
    rows: torch.Tensor,  # [num_tokens, kv, d]
    cache: torch.Tensor,  # [num_blocks, block_size + 1, kv, d] int8
    slots: list[int],
) -> None:
    """The module docstring's rules, one token and one head at a time, in float32."""
    block_size = cache.shape[1] - 1
    scales = block_scales(cache)
    max_q = torch.tensor(127.0)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for h in range(cache.shape[2]):
            x = rows[t, h].to(torch.float32)
            amax = x.abs().max()
            scale = scales[block, h].clone()
            if offset == 0:
                scale = amax / max_q
            elif amax > scale * max_q:
                new = torch.maximum(amax / max_q, scale * 1.25)
                earlier = cache[block, :offset, h].to(torch.float32)
                cache[block, :offset, h] = torch.round(earlier * (scale / new)).to(torch.int8)
                scale = new
            q = torch.round(x / scale).clamp(-127, 127) if scale > 0 else torch.zeros_like(x)
            cache[block, offset, h] = q.to(torch.int8)
            scales[block, h] = scale


SHAPES = [(16, 2, 64), (4, 1, 8), (5, 3, 12), (32, 4, 128)]  # block_size, kv heads, head_dim


@pytest.mark.parametrize(("block_size", "kv", "d"), SHAPES)
def test_reference_store_follows_the_rules_token_by_token(block_size: int, kv: int, d: int) -> None:
    tables = [[3, 0, 7], [5, 1], [2]]
    lens = [2 * block_size + 3, block_size + 1, block_size]
    slots = [*sequence_slots(tables, lens, block_size), -1]
    rows = grown_rows(len(slots), kv, d)
    want_k, want_v = stale_caches(8, block_size, kv, d)
    got_k, got_v = want_k.clone(), want_v.clone()
    naive_store(rows, want_k, slots)
    naive_store(-2 * rows, want_v, slots)
    reference.store_kv(rows, -2 * rows, got_k, got_v, torch.tensor(slots))
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)


def test_writing_one_token_a_call_gives_the_same_cache_as_one_call() -> None:
    block_size, kv, d = 8, 2, 16
    slots = sequence_slots([[2, 4, 1]], [21], block_size)
    rows = grown_rows(len(slots), kv, d, seed=3)
    whole_k, whole_v = stale_caches(5, block_size, kv, d)
    single_k, single_v = whole_k.clone(), whole_v.clone()
    reference.store_kv(rows, rows, whole_k, whole_v, torch.tensor(slots))
    for t, slot in enumerate(slots):
        reference.store_kv(
            rows[t : t + 1], rows[t : t + 1], single_k, single_v, torch.tensor([slot])
        )
    assert torch.equal(whole_k, single_k)


def test_a_reused_block_forgets_its_stale_scale() -> None:
    key_cache, value_cache = stale_caches(2, 4, 1, 8)
    block_scales(key_cache)[1] = 1e6  # would swallow every small value
    row = torch.full((1, 1, 8), 0.5)
    reference.store_kv(row, row, key_cache, value_cache, torch.tensor([4]))
    assert block_scales(key_cache)[1, 0] == pytest.approx(0.5 / 127)
    assert torch.equal(key_cache[1, 0, 0], torch.full((8,), 127, dtype=torch.int8))


@pytest.mark.parametrize("seed", range(4))
def test_error_stays_within_the_documented_bound(seed: int) -> None:
    """|x - x_hat| <= 2.5 * the final scale of its block and head (the module docstring)."""
    block_size, kv, d = 16, 3, 32
    slots = sequence_slots([[0, 1, 2, 3]], [60], block_size)
    rows = grown_rows(len(slots), kv, d, seed=seed)
    rows[0, :, 0] = 2 * rows[:block_size].abs().max()  # block 0's scale never grows
    key_cache, value_cache = stale_caches(4, block_size, kv, d, seed=seed)
    reference.store_kv(rows, rows, key_cache, value_cache, torch.tensor(slots))
    restored = dequantize_blocks(key_cache).reshape(-1, kv, d)[slots]
    final_scale = block_scales(key_cache)[torch.tensor(slots) // block_size]  # [tokens, kv]
    error = (restored - rows).abs().amax(dim=-1)
    assert bool((error <= 2.5 * final_scale * (1 + 1e-4)).all())
    # ... and, where a block's scale never grew, half a step of its first token's scale
    first = rows[::block_size].abs().amax(dim=-1) / 127  # [blocks, kv]
    steady = final_scale == first.repeat_interleave(block_size, 0)[: len(slots)]
    assert bool((error[steady] <= 0.5 * final_scale[steady] * (1 + 1e-4)).all())
    assert bool(steady.any())
    assert not bool(steady.all())


def test_int8_blocks_cost_under_a_quarter_of_float32_ones() -> None:
    per_block = int8_kv_cache.int8_bytes_per_block(16, 3, 64)
    assert per_block == 17 * 3 * 64
    assert 16 * 3 * 64 * 4 / per_block >= 3.5
    assert (
        int8_kv_cache.block_size_of(torch.zeros(int8_cache_shape(2, 16, 3, 64), dtype=torch.int8))
        == 16
    )
    assert int8_kv_cache.block_size_of(torch.zeros(2, 16, 3, 64)) == 16


@pytest.mark.parametrize("head_dim", [2, 6])
def test_head_dims_the_scale_row_cannot_hold_are_refused(head_dim: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        int8_cache_shape(4, 16, 2, head_dim)


# ---------------------------------------------------------------- native CPU kernels


@needs_compiler
@pytest.mark.parametrize(("block_size", "kv", "d"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_equals_the_reference_bit_for_bit(
    block_size: int, kv: int, d: int, dtype: torch.dtype
) -> None:
    tables = [[3, 0, 7], [5, 1], [2]]
    lens = [2 * block_size + 3, block_size + 1, block_size]
    slots = [-1, *sequence_slots(tables, lens, block_size)]
    qkv = grown_rows(len(slots), 3 * kv, d).to(dtype)  # k and v: strided views, as in the model
    key, value = qkv[:, kv : 2 * kv], qkv[:, 2 * kv :]
    want_k, want_v = stale_caches(8, block_size, kv, d)
    got_k, got_v = want_k.clone(), want_v.clone()
    slot_mapping = torch.tensor(slots)
    reference.store_kv(key.float(), value.float(), want_k, want_v, slot_mapping)
    cpu_attention.store_kv(key, value, got_k, got_v, slot_mapping)
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)


@needs_compiler
def test_native_store_refuses_a_slot_outside_the_cache() -> None:
    key_cache, value_cache = stale_caches(2, 4, 1, 8)
    before = key_cache.clone()
    rows = torch.randn(2, 1, 8)
    with pytest.raises(IndexError, match="outside"):
        cpu_attention.store_kv(rows, rows, key_cache, value_cache, torch.tensor([0, 8]))
    assert torch.equal(key_cache, before)


def dequantized(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize_blocks(key_cache), dequantize_blocks(value_cache)


@pytest.mark.parametrize(("num_heads", "kv"), [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize(("d", "block_size"), [(64, 16), (128, 32), (12, 5)])
@pytest.mark.parametrize("implementation", ["reference", "native"])
def test_decode_reads_int8_caches_as_their_dequantized_floats(
    num_heads: int, kv: int, d: int, block_size: int, implementation: str
) -> None:
    if implementation == "native" and find_compiler() is None:
        pytest.skip("no C compiler")
    lens = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 300]
    q, key_cache, value_cache, tables, seq_lens = random_int8_case(
        num_heads, kv, d, block_size, lens
    )
    attend = (cpu_attention if implementation == "native" else reference).paged_decode_attention
    got = attend(q, key_cache, value_cache, tables, seq_lens, d**-0.5)
    want = reference.paged_decode_attention(
        q, *dequantized(key_cache, value_cache), tables, seq_lens, d**-0.5
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_native_decode_gives_the_same_bits_for_any_thread_count() -> None:
    lens = [5 + 37 * i for i in range(9)]
    q, key_cache, value_cache, tables, seq_lens = random_int8_case(8, 2, 64, 16, lens)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(
                cpu_attention.paged_decode_attention(
                    q, key_cache, value_cache, tables, seq_lens, 0.125
                )
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@needs_compiler
def test_native_decode_takes_bfloat16_queries_over_an_int8_cache() -> None:
    q, key_cache, value_cache, tables, seq_lens = random_int8_case(8, 2, 64, 16, [3, 40, 77])
    got = cpu_attention.paged_decode_attention(
        q.bfloat16(), key_cache, value_cache, tables, seq_lens, 0.125
    )
    want = reference.paged_decode_attention(
        q.bfloat16().float(), *dequantized(key_cache, value_cache), tables, seq_lens, 0.125
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([70], [70]),  # a whole prompt on its own (PyTorch's causal attention)
        ([80, 5, 64], [80, 5, 64]),  # long and short whole prompts
        ([30, 1, 64], [50, 17, 100]),  # chunks continuing a cached prefix
    ],
)
@pytest.mark.parametrize(("num_heads", "kv", "d", "block_size"), [(8, 2, 64, 16), (3, 1, 12, 5)])
def test_prefill_reads_int8_caches_as_their_dequantized_floats(
    query_lens: list[int], seq_lens: list[int], num_heads: int, kv: int, d: int, block_size: int
) -> None:
    _, key_cache, value_cache, tables, lens = random_int8_case(
        num_heads, kv, d, block_size, seq_lens
    )
    q = torch.randn(sum(query_lens), num_heads, d, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = reference.paged_prefill_attention(
        q, *dequantized(key_cache, value_cache), tables, cu, lens, d**-0.5
    )
    for implementation in (cpu_attention, reference):
        got = implementation.paged_prefill_attention(
            q, key_cache, value_cache, tables, cu, lens, d**-0.5
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
