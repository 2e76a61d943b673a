"""The native CPU kernels (decode in C, whole-prompt prefill) against the PyTorch reference."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from kernels import cpu_attention, reference
from kernels.cpu_build import DISABLE_ENV, find_compiler

needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")


def random_case(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    lens: list[int],
    dtype: torch.dtype = torch.float32,
    pool_blocks: int = 512,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Queries, caches and non-contiguous random block tables drawn from a large pool."""
    gen = torch.Generator().manual_seed(seed)
    shape = (pool_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one spare column of padding
    ids = torch.randperm(pool_blocks, generator=gen)[: len(lens) * max_blocks]
    tables = ids.view(len(lens), max_blocks).to(torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


@needs_compiler
def test_native_library_builds_here() -> None:
    assert cpu_attention.native_library() is not None


# Both sides compute in float32; bfloat16 outputs may then round one ulp (2^-8) apart.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@needs_compiler
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_matches_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    # one partition (attention_items in paged_attention.h), several, and the most (16)
    lens = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 300, 1500]
    q, key_cache, value_cache, tables, seq_lens = random_case(
        num_heads, num_kv_heads, head_dim, block_size, lens, dtype=dtype, pool_blocks=1024
    )
    scale = head_dim**-0.5
    got = cpu_attention.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, scale)
    want = reference.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, scale)
    assert got.dtype == dtype
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@needs_compiler
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_gives_the_same_bits_alone_in_a_batch_and_on_any_team(
    cache_dtype: torch.dtype,
) -> None:
    """Few sequences run as one work item per partition of their context, many as whole
    sequences; a sequence's partitions depend on its own length alone, so each output has
    the same bits whichever way it ran, and for any thread count."""
    lens = [5 + 37 * i for i in range(9)] + [1100, 2000]  # 1-16 partitions
    q, key_cache, value_cache, tables, seq_lens = random_case(
        8, 2, 64, 16, lens, dtype=cache_dtype, pool_blocks=2048
    )
    batch = cpu_attention.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, 0.1)
    threads = torch.get_num_threads()
    try:
        for team in (1, 2, 3):
            torch.set_num_threads(team)
            for i in range(len(lens)):  # alone: one item per partition
                one = cpu_attention.paged_decode_attention(
                    q[i : i + 1],
                    key_cache,
                    value_cache,
                    tables[i : i + 1],
                    seq_lens[i : i + 1],
                    0.1,
                )
                assert torch.equal(one, batch[i : i + 1]), (team, lens[i])
    finally:
        torch.set_num_threads(threads)
    want = reference.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, 0.1)
    tolerance = TOLERANCES[cache_dtype]
    torch.testing.assert_close(batch, want, atol=tolerance, rtol=tolerance)


@needs_compiler
def test_native_decode_reads_strided_query_rows() -> None:
    """Queries may be a view into the fused q/k/v projection (rows further apart)."""
    q, key_cache, value_cache, tables, seq_lens = random_case(8, 2, 64, 16, [5, 40, 17])
    wide = torch.randn(3, 12, 64)
    wide[:, :8] = q
    strided = wide[:, :8]
    assert not strided.is_contiguous()
    got = cpu_attention.paged_decode_attention(
        strided, key_cache, value_cache, tables, seq_lens, 0.125
    )
    want = reference.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_native_decode_handles_an_empty_batch() -> None:
    q, key_cache, value_cache, tables, seq_lens = random_case(4, 2, 64, 16, [3])
    empty = cpu_attention.paged_decode_attention(
        q[:0], key_cache, value_cache, tables[:0], seq_lens[:0], 0.125
    )
    assert empty.shape == (0, 4, 64)


@needs_compiler
@pytest.mark.parametrize(
    ("table", "lens"),
    [
        ([[0, 1], [2, 9]], [20, 20]),  # block 9 is outside a 4-block cache
        ([[0], [1]], [20, 3]),  # 20 tokens need 2 blocks, the table lists 1
        ([[0, -1], [1, 2]], [20, 3]),  # a negative block id
    ],
)
def test_native_decode_refuses_tables_that_would_read_outside_the_cache(
    table: list[list[int]], lens: list[int]
) -> None:
    key_cache = torch.randn(4, 16, 2, 64)
    with pytest.raises(ValueError, match="block table"):
        cpu_attention.paged_decode_attention(
            torch.randn(2, 8, 64),
            key_cache,
            key_cache.clone(),
            torch.tensor(table, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            0.1,
        )


def test_other_dtypes_run_the_reference() -> None:
    q, key_cache, value_cache, tables, seq_lens = random_case(
        8, 2, 64, 16, [7, 33], dtype=torch.float16
    )
    got = cpu_attention.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, 0.125)
    want = reference.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, 0.125)
    assert torch.equal(got, want)


def test_native_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "reference")
    cpu_attention.native_library.cache_clear()
    try:
        assert cpu_attention.native_library() is None
        q, key_cache, value_cache, tables, seq_lens = random_case(8, 2, 64, 16, [7, 33])
        got = cpu_attention.paged_decode_attention(
            q, key_cache, value_cache, tables, seq_lens, 0.125
        )
        want = reference.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, 0.125)
        assert torch.equal(got, want)
    finally:
        monkeypatch.delenv(DISABLE_ENV)
        cpu_attention.native_library.cache_clear()


@needs_compiler
def test_engine_generates_the_same_tokens_on_the_native_kernel_and_the_reference(
    demo_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine (GQA, chunked prefill, mixed decode/prefill steps) with decode
    attention on the C kernel against the same engine on the PyTorch reference."""
    path = str(demo_checkpoint(architecture="LlamaForCausalLM", size="tiny"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (1, 9, 23, 40, 70)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate() -> list[list[int]]:
        llm = LLM(model=path, dtype="float32", max_num_batched_tokens=16)
        return [out.token_ids for out in llm.generate(prompts, greedy)]

    native = generate()
    monkeypatch.setenv(DISABLE_ENV, "reference")
    cpu_attention.native_library.cache_clear()
    try:
        assert cpu_attention.native_library() is None
        assert generate() == native
    finally:
        monkeypatch.delenv(DISABLE_ENV)
        cpu_attention.native_library.cache_clear()


# ---------------------------------------------------------------- prefill


def prefill_case(
    num_heads: int,
    num_kv_heads: int,
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    head_dim: int = 64,
) -> tuple[torch.Tensor, ...]:
    """Queries for chunks of new tokens (sequence i: the last query_lens[i] of seq_lens[i])
    over random caches and non-contiguous block tables."""
    _decode_queries, key_cache, value_cache, tables, lens = random_case(
        num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype=dtype
    )
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    return q, key_cache, value_cache, tables, cu, lens


PREFILL_BATCHES = {
    "long whole prompts": ([64, 100, 300], [64, 100, 300]),
    "short whole prompts only": ([1, 5, 63], [1, 5, 63]),
    "whole and continued": ([200, 17, 64, 1, 90], [200, 50, 64, 40, 90]),
    "continued only": ([30, 80], [100, 300]),
}


@pytest.mark.parametrize("batch", PREFILL_BATCHES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_matches_the_reference(
    batch: str, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    query_lens, seq_lens = PREFILL_BATCHES[batch]
    case = prefill_case(num_heads, num_kv_heads, query_lens, seq_lens, dtype=dtype)
    got = cpu_attention.paged_prefill_attention(*case, 0.125)
    want = reference.paged_prefill_attention(*case, 0.125)
    assert got.dtype == dtype
    assert got.shape == want.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_prefill_reads_strided_query_rows() -> None:
    """Queries are a view into the rotated q/k projection (rows further apart)."""
    q, key_cache, value_cache, tables, cu, lens = prefill_case(8, 2, [70, 90], [70, 90])
    wide = torch.randn(q.shape[0], 10, 64)
    wide[:, :8] = q
    strided = wide[:, :8]
    assert not strided.is_contiguous()
    got = cpu_attention.paged_prefill_attention(
        strided, key_cache, value_cache, tables, cu, lens, 0.1
    )
    want = reference.paged_prefill_attention(q, key_cache, value_cache, tables, cu, lens, 0.1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefill_handles_an_empty_batch() -> None:
    q, key_cache, value_cache, tables, cu, lens = prefill_case(4, 2, [3], [3])
    empty = cpu_attention.paged_prefill_attention(
        q[:0], key_cache, value_cache, tables[:0], cu[:1], lens[:0], 0.125
    )
    assert empty.shape == (0, 4, 64)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_matches_the_reference(dtype: torch.dtype) -> None:
    """Keys and values as views into a q/k/v projection (rows further apart), some slots
    skipped (-1), written into shuffled slots."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, 12, 64, generator=gen).to(dtype)
    key, value = qkv[:, 8:10], qkv[:, 10:]
    slots = torch.randperm(40 * 16, generator=gen)[:9]
    slots[[2, 7]] = -1
    got = tuple(torch.randn(40, 16, 2, 64, generator=gen).to(dtype) for _ in range(2))
    want = tuple(cache.clone() for cache in got)
    cpu_attention.store_kv(key, value, *got, slots)
    reference.store_kv(key, value, *want, slots)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@needs_compiler
@pytest.mark.parametrize("slot", [16 * 40, 10**6])
def test_native_store_kv_refuses_a_slot_outside_the_cache(slot: int) -> None:
    caches = (torch.zeros(40, 16, 2, 64), torch.zeros(40, 16, 2, 64))
    kv = torch.randn(3, 2, 64)
    with pytest.raises((IndexError, RuntimeError)):
        cpu_attention.store_kv(kv, kv, *caches, torch.tensor([0, slot, 5]))
    assert not caches[0].any()  # nothing written
