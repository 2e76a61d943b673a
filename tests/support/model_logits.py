"""Every position's logits of a token sequence, straight through a model (no engine)."""

from __future__ import annotations

import torch

from backend_engine.models.attention_metadata import AttentionMetadata
from backend_engine.models.llama import CausalLM


@torch.inference_mode()
def whole_sequence_logits(
    model: CausalLM, tokens: list[int], chunk_size: int | None = None
) -> torch.Tensor:
    """Every position's logits of ``tokens`` as one prompt, on a private KV cache; with
    ``chunk_size``, fed that many tokens a step (a chunked prefill), so each step's linears
    see at most that many rows, as decode steps do."""
    config = model.config
    block_size, num_tokens = 16, len(tokens)
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    int32 = torch.int32
    step = chunk_size or num_tokens
    logits = []
    for first in range(0, num_tokens, step):
        end = min(first + step, num_tokens)
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(first, end),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros((0, 0), dtype=int32),
            decode_seq_lens=torch.zeros(0, dtype=int32),
            prefill_block_tables=torch.arange(num_blocks, dtype=int32)[None],
            prefill_cu_seqlens_q=torch.tensor([0, end - first], dtype=int32),
            prefill_seq_lens=torch.tensor([end], dtype=int32),
            max_prefill_seq_len=end,
            max_prefill_query_len=end - first,
        )
        positions = torch.arange(first, end)
        hidden = model(torch.tensor(tokens[first:end]), positions, kv_caches, metadata)
        logits.append(model.compute_logits(hidden))
    return torch.cat(logits)
