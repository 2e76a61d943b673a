"""Random int8 KV caches, rows and block tables for the int8 cache's kernel tests (CPU and
Triton alike)."""

from __future__ import annotations

import torch

from kernels.int8_kv_cache import block_scales, int8_cache_shape


def stale_caches(
    num_blocks: int, block_size: int, kv: int, d: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches full of leftovers (random values, huge and tiny scales): reused blocks."""
    gen = torch.Generator().manual_seed(seed)
    shape = int8_cache_shape(num_blocks, block_size, kv, d)
    caches = []
    for _ in range(2):
        cache = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        block_scales(cache)[:] = torch.rand(num_blocks, kv, generator=gen) * 100
        caches.append(cache)
    return caches[0], caches[1]


def grown_rows(num_tokens: int, kv: int, d: int, seed: int = 0) -> torch.Tensor:
    """Rows whose magnitudes rise, fall and jump, so blocks' scales grow by small and large
    factors; some rows are all zero."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.rand(num_tokens, kv, 1, generator=gen) * 4 + 0.01
    magnitudes[::7] *= 30
    rows = torch.randn(num_tokens, kv, d, generator=gen) * magnitudes
    rows[5::11] = 0
    return rows


def sequence_slots(tables: list[list[int]], lens: list[int], block_size: int) -> list[int]:
    """Each sequence's slots for positions 0..len-1, sequence after sequence."""
    return [
        table[p // block_size] * block_size + p % block_size
        for table, n in zip(tables, lens, strict=True)
        for p in range(n)
    ]


def random_int8_case(
    num_heads: int, kv: int, d: int, block_size: int, lens: list[int], seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Queries, int8 caches with random values and scales, non-contiguous block tables."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    pool = len(lens) * max_blocks + 7
    key_cache, value_cache = stale_caches(pool, block_size, kv, d, seed=seed)
    for cache in (key_cache, value_cache):
        block_scales(cache)[:] = torch.rand(pool, kv, generator=gen) * 0.05 + 1e-3
    ids = torch.randperm(pool, generator=gen)[: len(lens) * max_blocks]
    tables = ids.view(len(lens), max_blocks).to(torch.int32)
    q = torch.randn(len(lens), num_heads, d, generator=gen)
    return q, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)
