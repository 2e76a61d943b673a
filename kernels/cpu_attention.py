"""The CPU implementation: native decode attention over paged blocks, the reference otherwise.

Decode attention runs the C kernel in ``kernels/csrc/paged_attention_cpu.c`` (built once
per machine by :mod:`kernels.cpu_build`), which reads each sequence's KV blocks in place
instead of gathering them first: one pass over the context's bytes instead of three. It
takes float32 or bfloat16 tensors in the reference layout (computing in float32, as the
reference does); anything else (float16, no C compiler, ``TOLLWAY_CPU_KERNELS=reference``)
runs :mod:`kernels.reference`, which is also the referee in the tests. ``store_kv`` is a
row copy per token in the same library.

An int8 cache (:mod:`kernels.int8_kv_cache`) takes the same paths: the C decode kernel
widens each block's int8 values times their scale as it reads them, ``store_kv`` quantizes
in C by the same rules as the reference (bit for bit), and prefill attention dequantizes the
blocks a prompt's context needs (those alone, once per call) before the float attention.

Prefill attention runs each whole prompt (a chunk with no cached prefix) of at least
``MIN_OWN_PROMPT_TOKENS`` tokens on its own through PyTorch's fused causal attention, its
grouped KV heads broadcast rather than copied. Shorter prompts, and chunks that continue a
cached prefix (they need a shifted causal mask), go to the reference. The reference pads
each bucket of mixed lengths up to 2x and takes SDPA's slower grouped-query path:
``python -m bench.cpu_kernels`` on the 2-core development machine gives 1.1-1.4x faster
prefill attention per layer for 1-16 prompts of mixed lengths between 32 and 512 tokens
(and 0.7-0.8x for 16 prompts of exactly 64: nothing to pad there), and a burst of 64 such
prompts prefilled 1.13-1.24x faster in the engine. ``TOLLWAY_CPU_KERNELS=reference`` sends
all of prefill to the reference too.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cpu_build import load_kernels, native_kernels_enabled
from kernels.int8_kv_cache import block_size_of, gather_blocks

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
_ABI_VERSION = 6
_BAD_BLOCK_TABLE = -2
# Shorter whole prompts share the reference's padded batches: an SDPA call costs ~0.1-0.2 ms
# whatever its size, more than a short prompt's attention. Measured per layer (interleaved,
# 2-core development machine): mixed lengths, the usual burst, run 1.1-1.8x faster one by one
# (16 prompts of 32-128 tokens 6.5 vs 5.7 ms, 64 of 32-512 289 vs 161 ms); equal lengths,
# where the reference pads nothing, 10-40% slower (16 prompts of 64 tokens 2.5-3.1 vs
# 3.0-4.4 ms).
MIN_OWN_PROMPT_TOKENS = 64
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's DTYPE_* values
_INT8_CODE = 2  # DTYPE_INT8: int8 caches (q and out float32 or bfloat16)


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or ``None`` when they are disabled or cannot be built."""
    pointers_and_sizes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 8
    store = [ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_int64] * 4
    store_int8 = [ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_int64] * 6
    return load_kernels(
        SOURCE,
        "CPU attention falls back to PyTorch",
        ("tollway_abi_version", _ABI_VERSION),
        {
            "tollway_paged_decode_attention": (
                [*pointers_and_sizes, ctypes.c_float, ctypes.c_int],
                ctypes.c_int,
            ),
            "tollway_store_kv": (store, ctypes.c_int),
            "tollway_store_kv_int8": (store_int8, ctypes.c_int),
        },
    )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """As :func:`kernels.reference.store_kv`: a row copy per token in C (the reference's
    check for skipped slots and two ``index_copy_`` calls cost ~40 us a layer)."""
    library = native_library()
    if library is None or not _native_can_store(key, value, key_cache, value_cache, slot_mapping):
        reference.store_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    if key_cache.dtype == torch.int8:
        _store_int8(library, key, value, key_cache, value_cache, slot_mapping)
        return
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    status = library.tollway_store_kv(
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_mapping.data_ptr(),
        _DTYPE_CODES[key.dtype],
        key.shape[0],
        key.stride(0),
        num_kv_heads * head_dim,
        num_blocks * block_size,
    )
    if status == _BAD_BLOCK_TABLE:
        raise IndexError(f"a slot lies outside the cache's {num_blocks * block_size} slots")


def _store_int8(
    library: ctypes.CDLL,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size + 1, num_kv_heads, head_dim] int8
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_blocks, _, num_kv_heads, head_dim = key_cache.shape
    block_size = block_size_of(key_cache)
    status = library.tollway_store_kv_int8(
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_mapping.data_ptr(),
        _DTYPE_CODES[key.dtype],
        key.shape[0],
        key.stride(0),
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks * block_size,
    )
    if status == _BAD_BLOCK_TABLE:
        raise IndexError(f"a slot lies outside the cache's {num_blocks * block_size} slots")
    if status != 0:
        raise MemoryError("store_kv could not allocate its work buffer")


def _native_can_store(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    rows = (key, value)
    cache_dtype = torch.int8 if key_cache.dtype == torch.int8 else key.dtype
    return (
        key.dtype in _DTYPE_CODES
        and value.dtype == key.dtype
        and key.device.type == value.device.type == "cpu"
        and all(t.dtype == cache_dtype and t.device.type == "cpu" for t in (key_cache, value_cache))
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.shape == (key.shape[0],)
        and key.shape == value.shape
        and key.stride(0) == value.stride(0)
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in rows)
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and key_cache.shape == value_cache.shape
        and key.shape[1:] == key_cache.shape[2:]
    )


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the query token
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    library = native_library()
    if library is None or not _native_can_run(q, key_cache, value_cache, block_tables, seq_lens):
        return reference.paged_decode_attention(
            q, key_cache, value_cache, block_tables, seq_lens, scale
        )
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    num_blocks, _, num_kv_heads, _ = key_cache.shape
    block_size = block_size_of(key_cache)
    cache_code = _INT8_CODE if key_cache.dtype == torch.int8 else _DTYPE_CODES[q.dtype]
    if num_seqs == 0:
        return out
    status = library.tollway_paged_decode_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        _DTYPE_CODES[q.dtype],
        cache_code,
        q.stride(0),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        block_tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if status == _BAD_BLOCK_TABLE:
        raise ValueError(
            "a block table is shorter than its sequence's context or names a block outside "
            f"the cache's {num_blocks} blocks"
        )
    if status != 0:
        raise MemoryError("paged decode attention could not allocate its work buffers")
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
    """As :func:`kernels.reference.paged_prefill_attention` (the chunk's keys already stored)."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    query_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    # Whole prompts long enough to repay a call of their own; the rest go to the reference.
    whole = [i for i, n in enumerate(lens) if MIN_OWN_PROMPT_TOKENS <= query_lens[i] == n]
    if not whole or not native_kernels_enabled():
        return reference.paged_prefill_attention(
            q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale
        )
    out = torch.empty_like(q)
    for i in whole:
        start, end = cu[i], cu[i + 1]
        out[start:end] = _causal_prompt_attention(
            q[start:end], key_cache, value_cache, block_tables[i], lens[i], scale
        )
    own = set(whole)
    continued = [i for i in range(len(lens)) if query_lens[i] > 0 and i not in own]
    if continued:
        token_idx = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in continued])
        sub_cu = [0]
        for i in continued:
            sub_cu.append(sub_cu[-1] + query_lens[i])
        rows = torch.tensor(continued)
        res = reference.paged_prefill_attention(
            q.index_select(0, token_idx),
            key_cache,
            value_cache,
            block_tables.index_select(0, rows),
            torch.tensor(sub_cu, dtype=torch.int32),
            seq_lens.index_select(0, rows),
            scale,
        )
        out.index_copy_(0, token_idx, res)
    return out


def _causal_prompt_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]: a whole prompt, positions 0..n-1
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil(n / block_size)] int32
    n: int,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim], q's dtype
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    block_size = block_size_of(key_cache)
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    compute_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    block_ids = block_table[: -(-n // block_size)]

    def context(cache: torch.Tensor) -> torch.Tensor:  # [kv, group, n, d], group a 0-stride view
        rows = gather_blocks(cache, block_ids)[:n].to(compute_dtype)
        return rows.transpose(0, 1)[:, None].expand(num_kv_heads, group, n, head_dim)

    # [kv, group, n, d]: query head h = kv * group + g, as in grouped-query attention
    qh = q.to(compute_dtype).view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    res = F.scaled_dot_product_attention(
        qh, context(key_cache), context(value_cache), is_causal=True, scale=scale
    )
    return res.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(q.dtype)


def _native_can_run(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> bool:
    cache_dtype = torch.int8 if key_cache.dtype == torch.int8 else q.dtype
    return (
        q.dtype in _DTYPE_CODES
        and q.device.type == "cpu"
        and all(t.dtype == cache_dtype and t.device.type == "cpu" for t in (key_cache, value_cache))
        and block_tables.dtype == torch.int32
        and seq_lens.dtype == torch.int32
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]  # a token's heads side by side; rows may be strided
        and all(t.is_contiguous() for t in (key_cache, value_cache, block_tables, seq_lens))
        and value_cache.shape == key_cache.shape
        and q.shape[1] % key_cache.shape[2] == 0
        and q.shape[2] == key_cache.shape[3]
        and seq_lens.shape[0] == q.shape[0] == block_tables.shape[0]
    )
