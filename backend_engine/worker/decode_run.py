"""A decode run on the model (``backend_engine.core.decode_runs``): ``k`` greedy decode steps
of one batch back to back, each step's argmax fed back as the next step's token.

Each step is the model's own decode step with its output projection (``forward_logits``),
then the argmax the sampler would take (``argmax_rows``), so a run's tokens are the tokens
the same steps taken one at a time would give. What a run saves is everything around that:
the positions, slots and context lengths of all ``k`` steps are laid out once, and no
scheduler, sampler or output processor runs between its steps. On the CPU's native decoder
the whole run is one native call (``CausalLM.native_decode_run``), each step from token ids
to argmax: the embedding row, the rotary angles, the layers, the output projection and
NumPy's argmax rule, each thread over its own logits, with nothing in Python between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend_engine.core.scheduler_output import ScheduledRequest
from backend_engine.models.attention_metadata import AttentionMetadata
from backend_engine.models.llama import CausalLM, KVCache
from backend_engine.worker.sampler import argmax_rows


def run_decodes(
    model: CausalLM,
    kv_caches: Sequence[KVCache],
    items: Sequence[ScheduledRequest],
    block_size: int,
    device: torch.device,
) -> list[list[int]]:
    """Each item's ``num_steps`` tokens (all items have the same count), computed from its
    one token at ``start_position`` into the slots its block table holds."""
    num_steps = items[0].num_steps
    if any(item.num_steps != num_steps or item.num_tokens != 1 for item in items):
        raise ValueError("a decode run takes one token per sequence and one step count")
    int32 = torch.int32
    # [num_steps, num_seqs]: step j computes position start + j of every sequence.
    positions = [[item.start_position + j for item in items] for j in range(num_steps)]
    slots = [
        [
            item.block_table[p // block_size] * block_size + p % block_size
            for item, p in zip(items, row, strict=True)
        ]
        for row in positions
    ]
    width = max(len(item.block_table) for item in items)
    tables = torch.tensor(
        [item.block_table + [0] * (width - len(item.block_table)) for item in items],
        dtype=int32,
        device=device,
    )
    positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
    slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
    seq_lens_t = (positions_t + 1).to(int32)
    no_prefills = torch.zeros((0, 0), dtype=int32, device=device)
    no_lens = torch.zeros(0, dtype=int32, device=device)
    no_queries = torch.zeros(1, dtype=int32, device=device)
    input_ids = torch.tensor([item.token_ids[0] for item in items], device=device)
    native = model.native_decode_run(kv_caches, input_ids, slots_t, tables, seq_lens_t)
    if native is not None:
        tokens: list[list[int]] = native.T.tolist()  # [num_seqs, num_steps]
        return tokens
    chosen: list[torch.Tensor] = []
    for j in range(num_steps):
        metadata = AttentionMetadata(
            slot_mapping=slots_t[j],
            num_decode_tokens=len(items),
            decode_block_tables=tables,
            decode_seq_lens=seq_lens_t[j],
            prefill_block_tables=no_prefills,
            prefill_cu_seqlens_q=no_queries,
            prefill_seq_lens=no_lens,
            max_decode_seq_len=max(positions[j]) + 1,
        )
        logits = model.forward_logits(input_ids, positions_t[j], kv_caches, metadata)
        input_ids = argmax_rows(logits).to(device)
        chosen.append(input_ids)
    stepped: list[list[int]] = torch.stack(chosen, dim=1).tolist()  # [num_seqs, num_steps]
    return stepped
