"""Paged-attention kernels: ``store_kv``, ``paged_decode_attention``, ``paged_prefill_attention``.

Each call dispatches on the query's device (see :mod:`kernels.dispatch`): CUDA goes to the
Triton kernels, CPU to :mod:`kernels.cpu_attention` (native C decode attention and KV stores,
built once per machine, per-prompt fused prefill, and the PyTorch reference behind them).
:mod:`kernels.reference` documents the cache layout and is the referee for both;
:mod:`kernels.int8_kv_cache` the int8 cache's (a scale row per block), which every
implementation reads and writes as stored. The model's other CPU kernels live beside them:
:mod:`kernels.cpu_linear`, :mod:`kernels.rms_norm` and :mod:`kernels.rotary`, and
:mod:`kernels.cpu_decoder`, which runs all of a decode step's layers in one call.
"""

from __future__ import annotations

import torch

from kernels.dispatch import implementation_for


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    impl = implementation_for(key.is_cuda, key.shape[-1])
    impl.store_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    impl = implementation_for(q.is_cuda, q.shape[-1])
    out: torch.Tensor = impl.paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, scale
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    impl = implementation_for(q.is_cuda, q.shape[-1])
    out: torch.Tensor = impl.paged_prefill_attention(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale
    )
    return out


__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
