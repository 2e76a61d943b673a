"""The Triton kernels against the PyTorch reference (interpreted on CPU, compiled on CUDA).

Tolerances: fp32 kernels use exact fp32 dot products (``input_precision="ieee"``) and differ
from the reference only by summation order. With fp16/bf16 inputs both sides accumulate in
fp32, but the kernels round the softmax probabilities to the input dtype before the P @ V
product (as flash attention does), and the output is rounded to the input dtype: fp16
(~2^-11 relative) and bf16 (~2^-8) get tolerances a few units of that rounding wide.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

import kernels
from backend_engine import LLM, SamplingParams
from kernels import cpu_attention, dispatch, reference, triton_attention
from kernels.triton_decode import choose_partition_size

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
NUM_KV_HEADS = 2
POOL_BLOCKS = 512  # large next to the ~20 blocks a case uses: block ids are scattered


@dataclass(frozen=True)
class Case:
    group: int  # query heads per KV head (GQA ratio)
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"gqa{self.group}-d{self.head_dim}-bs{self.block_size}-{dtype}"


# A hand-picked slice of {1, 4, 7} x {64, 128} x {16, 32} x {fp32, fp16, bf16}: every value of
# every axis appears in at least two cases, with both precisions at each GQA ratio.
CASES = [
    Case(1, 64, 16, torch.float32),
    Case(1, 128, 32, torch.bfloat16),
    Case(4, 128, 32, torch.float32),
    Case(4, 64, 16, torch.float16),
    Case(7, 64, 32, torch.float32),
    Case(7, 128, 16, torch.bfloat16),
]


def make_cache(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (POOL_BLOCKS, case.block_size, NUM_KV_HEADS, case.head_dim)
    return (
        torch.randn(shape, generator=gen).to(case.dtype),
        torch.randn(shape, generator=gen).to(case.dtype),
    )


def random_block_tables(
    seq_lens: list[int], block_size: int, gen: torch.Generator
) -> torch.Tensor:  # [num_seqs, max_blocks + 2] int32
    """Distinct, shuffled blocks from the pool, padded with garbage (but valid) ids."""
    needed = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(POOL_BLOCKS, generator=gen).tolist()
    shape = (len(seq_lens), max(needed) + 2)
    table = torch.randint(0, POOL_BLOCKS, shape, generator=gen, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    return table


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def assert_close_to(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert out.shape == expected.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("partition_size", [512, 32])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decode_matches_reference(case: Case, partition_size: int) -> None:
    """512: one partition, written directly; 32: several partitions merged by log-sum-exp."""
    gen = torch.Generator().manual_seed(case.group * 1000 + case.head_dim + case.block_size)
    bs = case.block_size
    # ragged: a single token, mid-block ends, exact block multiples, several tiles
    seq_lens = [1, 7, bs, bs + 1, 3 * bs - 5, 100, 41]
    key_cache, value_cache = make_cache(case, gen)
    tables = random_block_tables(seq_lens, bs, gen)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * case.group, case.head_dim, generator=gen)
    q = q.to(case.dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(case.head_dim)

    expected = reference.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale)
    out = triton_attention.paged_decode_attention(
        *on_device(q, key_cache, value_cache, tables, lens), scale, partition_size=partition_size
    )
    assert_close_to(out, expected, case.dtype)


def test_decode_long_context_default_partitions() -> None:
    """600 keys: two default partitions, each several key tiles long."""
    case = Case(4, 64, 16, torch.float32)
    gen = torch.Generator().manual_seed(7)
    seq_lens = [600, 513, 3]
    key_cache, value_cache = make_cache(case, gen)
    tables = random_block_tables(seq_lens, case.block_size, gen)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * case.group, case.head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = reference.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)
    out = triton_attention.paged_decode_attention(
        *on_device(q, key_cache, value_cache, tables, lens), 0.125
    )
    assert_close_to(out, expected, case.dtype)


def test_default_partition_size_fills_the_device() -> None:
    num_sms = 132  # H100/H200
    assert choose_partition_size(256, 8, 32768, num_sms) == 512
    assert choose_partition_size(1, 8, 32768, num_sms) == 256  # 8 x 128 >= 4 x 132 programs
    assert choose_partition_size(1, 8, 512, num_sms) == 64  # the floor
    assert choose_partition_size(1, 8, 512, None) == 512  # not on a GPU: no SM count


def test_decode_empty_batch() -> None:
    key_cache, value_cache = on_device(
        *make_cache(Case(1, 64, 16, torch.float32), torch.Generator())
    )
    q, tables, lens = on_device(
        torch.randn(0, 2, 64),
        torch.zeros(0, 0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
    )
    out = triton_attention.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)
    assert out.shape == (0, 2, 64)


# ---------------------------------------------------------------- prefill


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_prefill_matches_reference(case: Case) -> None:
    gen = torch.Generator().manual_seed(case.group * 1000 + case.head_dim + case.block_size + 1)
    bs = case.block_size
    # (context length, new tokens): fresh prompts, chunks after a cached prefix, 1-token chunks,
    # a chunk spanning several query and key tiles
    cases = [(1, 1), (37, 37), (70, 10), (bs, 1), (2 * bs + 3, bs), (100, 70)]
    seq_lens = [n for n, _ in cases]
    query_lens = [qn for _, qn in cases]
    key_cache, value_cache = make_cache(case, gen)
    tables = random_block_tables(seq_lens, bs, gen)
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * case.group, case.head_dim, generator=gen)
    q = q.to(case.dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(case.head_dim)

    expected = reference.paged_prefill_attention(q, key_cache, value_cache, tables, cu, lens, scale)
    out = triton_attention.paged_prefill_attention(
        *on_device(q, key_cache, value_cache, tables, cu, lens), scale
    )
    assert_close_to(out, expected, case.dtype)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_store_kv_matches_reference(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Strided inputs (slices of a fused projection), -1 slots skipped, nothing else written.

    Same-dtype stores are bit-exact. Converting fp32 -> bf16 may differ by one bf16 ulp:
    the GPU rounds to nearest even, Triton's interpreter truncates.
    """
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, head_dim, block_size, num_blocks = 3, 64, 16, 40
    num_tokens = 9
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)

    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    key_d, value_d, key_cache_d, value_cache_d, slots_d = on_device(
        key, value, key_cache, value_cache, slots
    )
    triton_attention.store_kv(key_d, value_d, key_cache_d, value_cache_d, slots_d)
    rtol = 0.0 if dtype == cache_dtype else 2**-7
    torch.testing.assert_close(key_cache_d.cpu(), expected_k, atol=0.0, rtol=rtol)
    torch.testing.assert_close(value_cache_d.cpu(), expected_v, atol=0.0, rtol=rtol)


# ---------------------------------------------------------------- interface


@pytest.mark.parametrize("head_dim", [8, 48, 96])
def test_unsupported_head_dim_raises(head_dim: int) -> None:
    key_cache = torch.zeros(4, 16, 1, head_dim)
    q = torch.zeros(1, 2, head_dim)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim"):
        triton_attention.paged_decode_attention(q, key_cache, key_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        triton_attention.store_kv(q[:, :1], q[:, :1], key_cache, key_cache, lens.long())


def test_bad_partition_size_raises() -> None:
    key_cache = torch.zeros(4, 16, 1, 64)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="partition_size"):
        triton_attention.paged_decode_attention(
            torch.zeros(1, 1, 64), key_cache, key_cache, tables, lens, 1.0, partition_size=48
        )


def test_dispatch_picks_triton_for_cuda_and_the_cpu_kernels_otherwise() -> None:
    assert dispatch.implementation_for(is_cuda=True) is triton_attention
    assert dispatch.implementation_for(is_cuda=False) is cpu_attention
    for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
        assert callable(getattr(triton_attention, name))


def test_engine_generates_the_same_tokens_with_triton_kernels(
    demo_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine (GQA, chunked prefill after cached prefixes, mixed decode/prefill
    batches) on the Triton kernels, interpreted here, against the same engine on the reference.
    """
    path = str(demo_checkpoint(architecture="LlamaForCausalLM", size="tiny"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (1, 9, 23, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate(implementation: ModuleType) -> list[list[int]]:
        monkeypatch.setattr(kernels, "implementation_for", lambda *_args, **_kwargs: implementation)
        llm = LLM(model=path, device=DEVICE.type, dtype="float32", max_num_batched_tokens=13)
        return [out.token_ids for out in llm.generate(prompts, greedy)]

    assert generate(triton_attention) == generate(reference)


def test_dispatch_falls_back_to_the_reference_for_untileable_head_dims() -> None:
    assert dispatch.implementation_for(True, 96) is reference
    assert dispatch.implementation_for(True, 8) is reference
    assert dispatch.implementation_for(False, 128) is cpu_attention
