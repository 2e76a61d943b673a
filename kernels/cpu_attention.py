"""The CPU implementation: native decode attention over paged blocks, the reference otherwise.

Decode attention runs the C kernel in ``kernels/csrc/paged_attention_cpu.c`` (built once
per machine by :mod:`kernels.cpu_build`), which reads each sequence's KV blocks in place
instead of gathering them first: one pass over the context's bytes instead of three. It
takes float32 or bfloat16 tensors in the reference layout (computing in float32, as the
reference does); anything else (float16, no C compiler, ``TOLLWAY_CPU_KERNELS=reference``)
runs :mod:`kernels.reference`, which is also the referee in the tests. ``store_kv`` and
prefill attention are the reference's.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from kernels import reference
from kernels.cpu_build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
_ABI_VERSION = 4
_BAD_BLOCK_TABLE = -2
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's DTYPE_* values

store_kv = reference.store_kv
paged_prefill_attention = reference.paged_prefill_attention


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or ``None`` when they are disabled or cannot be built."""
    library = load_library(SOURCE, "CPU kernels fall back to PyTorch")
    if library is None:
        return None
    if library.tollway_abi_version() != _ABI_VERSION:
        logger.warning("%s has an unexpected ABI version; using PyTorch", SOURCE.name)
        return None
    decode = library.tollway_paged_decode_attention
    decode.argtypes = (
        [ctypes.c_void_p] * 6
        + [ctypes.c_int]
        + [ctypes.c_int64] * 8
        + [ctypes.c_float, ctypes.c_int]
    )
    decode.restype = ctypes.c_int
    return library


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
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
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


def _native_can_run(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> bool:
    floats = (q, key_cache, value_cache)
    return (
        q.dtype in _DTYPE_CODES
        and all(t.dtype == q.dtype and t.device.type == "cpu" for t in floats)
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
