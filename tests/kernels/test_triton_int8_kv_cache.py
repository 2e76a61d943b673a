"""The Triton kernels on int8 KV caches against the PyTorch reference (Triton's interpreter
without a GPU).

The store follows the same float32 rules; under the interpreter (numpy) it equals the
reference bit for bit, and on a GPU a value may round one step apart where a quotient lands
within an ulp of a half. Attention is compared with the float reference over the
dequantized cache, at the float kernels' tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference, triton_attention
from kernels.int8_kv_cache import block_scales, dequantize_blocks
from tests.support.int8_kv_cases import (
    grown_rows,
    random_int8_case,
    sequence_slots,
    stale_caches,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def assert_same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    if DEVICE.type == "cpu":  # the interpreter: exact
        assert torch.equal(got, want)
        return
    steps = (got[:, :-1].to(torch.int16) - want[:, :-1].to(torch.int16)).abs()
    assert int(steps.max()) <= 1
    torch.testing.assert_close(block_scales(got), block_scales(want), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("block_size", "kv", "d"), [(16, 2, 64), (4, 1, 16), (5, 3, 32)])
def test_store_follows_the_reference(block_size: int, kv: int, d: int) -> None:
    """Whole prompts, skipped slots and strided rows in one call; then a chunk continuing a
    block mid-way, a decode token at a block's end and one starting a fresh block."""
    tables = [[3, 0, 7], [5, 1], [2, 6]]
    lens = [2 * block_size + 3, block_size + 1, block_size]
    slots = [-1, *sequence_slots(tables, lens, block_size), -1]
    chunk = [block_size + 1 + i for i in range(min(3, block_size - 1))]  # sequence 1, block 1
    decode = [
        *(tables[1][p // block_size] * block_size + p % block_size for p in chunk),
        tables[0][lens[0] // block_size] * block_size + lens[0] % block_size,
        6 * block_size,  # sequence 2's next token: block 6's first slot
    ]
    fused = grown_rows(len(slots) + len(decode), 3 * kv, d)  # k and v: views of q/k/v rows
    key, value = fused[:, kv : 2 * kv], fused[:, 2 * kv :]
    want_k, want_v = stale_caches(8, block_size, kv, d)
    got_k, got_v = on_device(want_k, want_v)
    for rows, step in ((slice(0, len(slots)), slots), (slice(len(slots), None), decode)):
        slot_mapping = torch.tensor(step)
        reference.store_kv(key[rows], value[rows], want_k, want_v, slot_mapping)
        key_d, value_d, slots_d = on_device(key[rows], value[rows], slot_mapping)
        triton_attention.store_kv(key_d, value_d, got_k, got_v, slots_d)
        assert_same_cache(got_k.cpu(), want_k)
        assert_same_cache(got_v.cpu(), want_v)


@pytest.mark.parametrize("partition_size", [512, 32])
@pytest.mark.parametrize(
    ("group", "d", "block_size", "dtype"),
    [
        (1, 64, 16, torch.float32),
        (4, 128, 32, torch.bfloat16),
        (7, 64, 16, torch.float16),
    ],
)
def test_decode_reads_the_dequantized_cache(
    group: int, d: int, block_size: int, dtype: torch.dtype, partition_size: int
) -> None:
    lens = [1, 7, block_size, block_size + 1, 3 * block_size - 5, 100]
    q, key_cache, value_cache, tables, seq_lens = random_int8_case(
        2 * group, 2, d, block_size, lens
    )
    q = q.to(dtype)
    scale = 1 / math.sqrt(d)
    want = reference.paged_decode_attention(
        q, dequantize_blocks(key_cache), dequantize_blocks(value_cache), tables, seq_lens, scale
    )
    q_d, key_d, value_d, tables_d, lens_d = on_device(q, key_cache, value_cache, tables, seq_lens)
    got = triton_attention.paged_decode_attention(
        q_d, key_d, value_d, tables_d, lens_d, scale, partition_size=partition_size
    )
    assert got.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("group", "d", "block_size", "dtype"),
    [(1, 64, 16, torch.float32), (4, 64, 32, torch.bfloat16), (7, 32, 16, torch.float32)],
)
def test_prefill_reads_the_dequantized_cache(
    group: int, d: int, block_size: int, dtype: torch.dtype
) -> None:
    cases = [(1, 1), (37, 37), (70, 10), (block_size, 1), (2 * block_size + 3, block_size)]
    seq_lens = [n for n, _ in cases]
    query_lens = [qn for _, qn in cases]
    _, key_cache, value_cache, tables, lens = random_int8_case(
        2 * group, 2, d, block_size, seq_lens
    )
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(query_lens), 2 * group, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    want = reference.paged_prefill_attention(
        q, dequantize_blocks(key_cache), dequantize_blocks(value_cache), tables, cu, lens, scale
    )
    q_d, key_d, value_d, tables_d, cu_d, lens_d = on_device(
        q, key_cache, value_cache, tables, cu, lens
    )
    got = triton_attention.paged_prefill_attention(
        q_d, key_d, value_d, tables_d, cu_d, lens_d, scale
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
