"""What one forward pass needs to know about its packed batch for paged attention.

The batch is flat: ``num_tokens`` tokens from several sequences, decodes first.

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]
              decodes    prefill seq 0  prefill seq 1
              (1 each)   (a chunk)      (a chunk)

Decode sequences contribute exactly one query token each; prefill sequences
contribute a chunk of new tokens that attend to their cached prefix (read through
the block table) and causally to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 means "do not store"
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context length incl. the new token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, offsets into the prefill tokens
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context length incl. the new tokens
    max_decode_seq_len: int = 0
    max_prefill_seq_len: int = 0
    max_prefill_query_len: int = 0

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_lens.shape[0])
