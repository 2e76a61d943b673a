"""bench.single_stream_decode: the weight bytes a decode step reads, per arm."""

from __future__ import annotations

import torch
from torch import nn

from backend_engine.models.packed_linear import PackedLinear, can_pack
from backend_engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from bench.single_stream_decode import copy_bandwidth, weight_bytes_read
from kernels.cpu_quant_linear import GGUFBlockWeight, GGUFQuantType

Q4_1_BLOCK_BYTES = 20  # per 32 values
Q8_0_BLOCK_BYTES = 34


def blocks(out_features: int, in_features: int, block_bytes: int, kind: int) -> GGUFBlockWeight:
    data = torch.zeros((out_features, in_features // 32 * block_bytes), dtype=torch.uint8)
    return GGUFBlockWeight.from_blocks(data, kind)


class TinyModel(nn.Module):
    """An embedding tied to the output projection, one quantized linear, one norm."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        table = blocks(vocab, hidden, Q8_0_BLOCK_BYTES, GGUFQuantType.Q8_0)
        self.embed = QuantizedEmbedding(table, torch.float32)
        self.proj = QuantizedLinear([blocks(2 * hidden, hidden, Q4_1_BLOCK_BYTES, 3)], None)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = QuantizedLinear([table], None)


def test_quantized_weights_count_as_stored_and_a_tied_table_once_as_the_projection() -> None:
    vocab, hidden = 100, 64
    model = TinyModel(vocab, hidden)
    expected = (
        2 * hidden * (hidden // 32) * Q4_1_BLOCK_BYTES  # proj's blocks
        + vocab * (hidden // 32) * Q8_0_BLOCK_BYTES  # the output projection (tied)
        + hidden * 4  # the norm
    )
    assert weight_bytes_read(model) == expected


def test_float_linears_count_their_elements_packed_or_not() -> None:
    plain = nn.Linear(64, 32, bias=True)
    model = nn.Sequential(nn.Embedding(1000, 64), plain)
    assert weight_bytes_read(model) == (64 * 32 + 32) * 4  # the embedding table is not read
    linear = nn.Linear(64, 32, bias=False)
    if can_pack(linear):
        assert weight_bytes_read(nn.Sequential(PackedLinear(linear))) == 64 * 32 * 4


def test_the_roofline_copy_runs_on_both_kinds_of_pages() -> None:
    """The roofline's bandwidth is a copy on huge pages (where the engine's weights and KV
    cache live), the same copy on 4 KiB pages printed beside it: both run and give a rate."""
    for huge_pages in (False, True):
        rate = copy_bandwidth(4 << 20, huge_pages=huge_pages)
        assert 1e8 < rate < float("inf")
