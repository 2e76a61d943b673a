"""QuantizedLinear and QuantizedEmbedding against dequantize-then-matmul, and how shards become
segments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from backend_engine.models.quantized_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize,
    merge_shards,
    move_blocks_to_huge_pages,
)
from kernels import cpu_quant_linear
from kernels.cpu_quant_linear import GGUFBlockWeight
from kernels.huge_pages import HUGE_PAGE_BYTES
from kernels.quantized_weights import quantize_int4, quantize_int8


def blocks(rows: int, columns: int, kind: GGMLQuantizationType, seed: int) -> GGUFBlockWeight:
    values = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    return GGUFBlockWeight.from_blocks(torch.from_numpy(quants.quantize(values, kind)), int(kind))


def assert_matches_dequantized(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    want = x.double() @ weight.double().T
    bound = 1e-4 * (x.double().abs() @ weight.double().abs().T) + 1e-5
    assert bool(((y.double() - want).abs() <= bound).all())


def test_one_type_of_shards_becomes_one_segment() -> None:
    q, k = (
        blocks(64, 96, GGMLQuantizationType.Q4_1, 0),
        blocks(32, 96, GGMLQuantizationType.Q4_1, 1),
    )
    (segment,) = merge_shards([q, k])
    assert isinstance(segment, GGUFBlockWeight)
    assert segment.out_features == 96
    assert torch.equal(dequantize(segment), torch.cat([dequantize(q), dequantize(k)]))


def test_shards_of_other_types_stay_apart_and_fill_their_columns() -> None:
    shards = [
        blocks(64, 96, GGMLQuantizationType.Q4_0, 0),
        blocks(32, 96, GGMLQuantizationType.Q4_0, 1),
        blocks(32, 96, GGMLQuantizationType.Q8_0, 2),
    ]
    bias = torch.randn(128)
    linear = QuantizedLinear(shards, bias)
    assert [s.out_features for s in linear.segments] == [96, 32]
    assert linear.native_segments is not None
    x = torch.randn(5, 96)
    weight = torch.cat([dequantize(s) for s in shards])
    assert_matches_dequantized(linear(x) - bias, x, weight)
    assert linear.weight_bytes() == sum(s.blocks.nbytes for s in shards)


def test_more_segments_than_the_decoder_takes_run_in_python_only() -> None:
    kinds = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0] * 2
    linear = QuantizedLinear([blocks(32, 64, kind, i) for i, kind in enumerate(kinds)], None)
    assert len(linear.segments) == 4
    assert linear.native_segments is None
    x = torch.randn(3, 64)
    weight = torch.cat([dequantize(s) for s in linear.segments])
    assert_matches_dequantized(linear(x), x, weight)


def test_triton_formats_merge_but_are_not_native() -> None:
    first, second = torch.randn(32, 64), torch.randn(16, 64)
    (int8,) = merge_shards([quantize_int8(first), quantize_int8(second)])
    assert torch.equal(
        dequantize(int8), torch.cat([dequantize(quantize_int8(w)) for w in (first, second)])
    )
    mixed = merge_shards([quantize_int4(first, 32), quantize_int4(second, 64)])
    assert len(mixed) == 2  # another group size
    assert QuantizedLinear(mixed, None).native_segments is None


def test_int4_shards_merge_with_their_scales_and_mins() -> None:
    first, second = torch.randn(32, 64) + 0.5, torch.randn(16, 64) - 0.5
    shards = [quantize_int4(w, 32, torch.float16) for w in (first, second)]
    (int4,) = merge_shards(shards)
    assert torch.equal(dequantize(int4), torch.cat([dequantize(s) for s in shards]))
    linear = QuantizedLinear(shards, None)
    expected_bytes = sum(s.packed.nbytes + s.scales.nbytes + s.mins.nbytes for s in shards)
    assert linear.weight_bytes() == expected_bytes == 48 * 32 + 2 * 48 * 2 * 2


def test_a_bias_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        QuantizedLinear([blocks(32, 64, GGMLQuantizationType.Q8_0, 0)], torch.zeros(31))


def test_the_embedding_widens_exactly_the_rows_asked_for() -> None:
    table = blocks(50, 64, GGMLQuantizationType.Q8_0, 3)
    embedding = QuantizedEmbedding(table, torch.float32)
    ids = torch.tensor([7, 0, 49, 7])
    assert torch.equal(embedding(ids), dequantize(table)[ids])
    assert embedding(torch.zeros(0, dtype=torch.int64)).shape == (0, 64)
    assert embedding.weight_bytes() == table.blocks.nbytes


def test_ggml_segments_are_tiled_all_or_none() -> None:
    tileable = [
        blocks(64, 96, GGMLQuantizationType.Q4_1, 0),
        blocks(32, 96, GGMLQuantizationType.Q8_0, 1),
    ]
    linear = QuantizedLinear(tileable, None)
    tiles = cpu_quant_linear.tiles_available()
    assert [getattr(s, "tiled", None) for s in linear.segments] == [tiles, tiles]
    x = torch.randn(3, 96)
    weight = torch.cat([dequantize(s) for s in tileable])
    assert_matches_dequantized(linear(x), x, weight)
    # a Q5_0 beside them cannot be tiled, so none is (the decoder takes all or none)
    mixed = QuantizedLinear([*tileable, blocks(32, 96, GGMLQuantizationType.Q5_0, 2)], None)
    assert not any(getattr(s, "tiled", False) for s in mixed.segments)
    assert linear.weight_bytes() == mixed.weight_bytes() - mixed.segments[2].blocks.nbytes


def test_a_tiled_table_embeds_the_same_rows() -> None:
    table = blocks(64, 96, GGMLQuantizationType.Q8_0, 4)
    tiled = table.tiled_for_kernel()
    ids = torch.tensor([63, 0, 17, 17, 40])
    want = QuantizedEmbedding(table, torch.float32)(ids)
    assert torch.equal(QuantizedEmbedding(tiled, torch.float32)(ids), want)
    assert torch.equal(want, dequantize(table)[ids])


def test_blocks_move_to_one_huge_page_mapping_and_shared_blocks_stay_shared() -> None:
    table = blocks(64, 96, GGMLQuantizationType.Q8_0, 5)
    output = QuantizedLinear([table], None)  # a tied output projection and embedding
    (shared,) = output.segments
    assert isinstance(shared, GGUFBlockWeight)
    embedding = QuantizedEmbedding(shared, torch.float32)
    q4_1, q5_0 = (
        blocks(32, 96, GGMLQuantizationType.Q4_1, 6),
        blocks(32, 96, GGMLQuantizationType.Q5_0, 7),
    )
    mixed = QuantizedLinear([q4_1, q5_0], torch.randn(64))
    model = torch.nn.ModuleDict({"output": output, "embedding": embedding, "mixed": mixed})
    x, ids = torch.randn(3, 96), torch.tensor([5, 63, 0])
    want = (output(x), embedding(ids), mixed(x))
    before = [segment.blocks for segment in (*output.segments, *mixed.segments)]  # type: ignore[union-attr]

    assert move_blocks_to_huge_pages(model) == sum(b.nbytes for b in before)

    after = [segment.blocks for segment in (*output.segments, *mixed.segments)]  # type: ignore[union-attr]
    assert embedding.weight.blocks is after[0]  # still one copy for both
    for moved, old in zip(after, before, strict=True):
        assert torch.equal(moved, old)
        assert moved.data_ptr() != old.data_ptr()
    pointers = sorted(b.data_ptr() for b in after)  # one mapping, from a huge page's start
    assert pointers[0] % HUGE_PAGE_BYTES == 0
    assert pointers[-1] - pointers[0] < HUGE_PAGE_BYTES
    got = (output(x), embedding(ids), mixed(x))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
