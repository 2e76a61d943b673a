"""Tiled GGUF weights (kernels/quant_tiles.py, kernels/csrc/quant_tiles.h): the layout is the
file's bytes regrouped, and the tiled kernel computes what the row kernel's split method does
(the same integers per block, summed in another float order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kernels import cpu_quant_linear, quant_tiles
from kernels.cpu_quant_linear import GGUFBlockWeight, QuantLinearMethod, quantized_linear
from tests.kernels.test_cpu_quant_linear import (
    ROUNDING,
    assert_close,
    needs_native,
    quantized_case,
)

TILEABLE = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
SPLIT = QuantLinearMethod.INT8_SPLIT_ACTIVATIONS
needs_tiles = pytest.mark.skipif(
    not cpu_quant_linear.tiles_available(), reason="the kernel here has no AVX-512 VNNI"
)


def tiled_case(
    kind: GGMLQuantizationType, out_features: int, in_features: int, seed: int = 0
) -> tuple[GGUFBlockWeight, GGUFBlockWeight, torch.Tensor]:
    weight, reference = quantized_case(kind, out_features, in_features, seed)
    tiled = GGUFBlockWeight(
        quant_tiles.tile(weight.blocks, int(kind)),
        weight.quant_type,
        out_features,
        in_features,
        tiled=True,
    )
    return weight, tiled, reference


@pytest.mark.parametrize("kind", TILEABLE, ids=lambda kind: kind.name)
def test_tiles_are_the_file_bytes_regrouped(kind: GGMLQuantizationType) -> None:
    weight, tiled, _ = tiled_case(kind, 48, 96)
    assert tiled.blocks.nbytes == weight.blocks.nbytes
    assert torch.equal(tiled.in_file_layout().blocks, weight.blocks)
    rows = torch.tensor([0, 47, 17, 17, 30])
    assert torch.equal(tiled.row_blocks(rows), weight.blocks[rows])
    assert torch.equal(tiled.row_range(3, 45).blocks, weight.blocks[3:45])
    assert torch.equal(tiled.row_range(16, 32).blocks, weight.blocks[16:32])
    # the first tile-block: 16 fp16 scales, then row j's first quant word at 4 j
    fields = 4 if kind == GGMLQuantizationType.Q4_1 else 2
    first = tiled.blocks[0]
    block_bytes = weight.blocks.shape[1] // 3
    for j in (0, 5, 15):
        assert torch.equal(first[2 * j : 2 * j + 2], weight.blocks[j, 0:2])
        word = first[16 * fields + 4 * j : 16 * fields + 4 * j + 4]
        quants = weight.blocks[j, fields : fields + 4]
        want = quants ^ 0x80 if kind == GGMLQuantizationType.Q8_0 else quants
        assert torch.equal(word, want)
    assert block_bytes * 16 * 3 == first.numel()


def test_only_whole_tiles_of_the_32_value_types_tile() -> None:
    assert quant_tiles.is_tileable(int(GGMLQuantizationType.Q4_1), 32)
    assert not quant_tiles.is_tileable(int(GGMLQuantizationType.Q4_1), 40)
    assert not quant_tiles.is_tileable(int(GGMLQuantizationType.Q5_0), 32)
    assert not quant_tiles.is_tileable(int(GGMLQuantizationType.Q6_K), 32)
    weight, _ = quantized_case(GGMLQuantizationType.Q4_1, 40, 64)
    assert weight.tiled_for_kernel() is weight
    weight, _ = quantized_case(GGMLQuantizationType.Q5_1, 32, 64)
    assert weight.tiled_for_kernel() is weight


@needs_native
@needs_tiles
@pytest.mark.parametrize("kind", TILEABLE, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64, 67, 130])  # 130: past 64-row chunks
def test_tiled_kernel_matches_the_dequantized_matmul(kind: GGMLQuantizationType, rows: int) -> None:
    for out_features, in_features in ((16, 32), (48, 96), (112, 320)):
        weight, tiled, reference = tiled_case(kind, out_features, in_features, seed=rows)
        assert tiled.tiled_for_kernel() is tiled
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        y = quantized_linear(x, tiled, SPLIT)
        assert_close(y, x, reference, SPLIT)
        # the row kernel's split method: the same integers, float sums in another order
        rows_y = quantized_linear(x, weight, SPLIT)
        scale = x.abs() @ reference.abs().T
        assert bool(((y - rows_y).abs() <= 2 * ROUNDING * scale + 1e-6).all())
        assert torch.equal(quantized_linear(x, tiled), y)  # the default for any row count


@needs_native
@needs_tiles
@pytest.mark.parametrize("kind", TILEABLE, ids=lambda kind: kind.name)
def test_tiled_kernel_is_bit_identical_for_any_thread_count(kind: GGMLQuantizationType) -> None:
    _, tiled, _ = tiled_case(kind, 96, 160)
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(1))
    want = quantized_linear(x, tiled, SPLIT, num_threads=1)
    for threads in (2, 3, 5, 6, 8):  # 6 tiles: more threads than tiles too
        assert torch.equal(quantized_linear(x, tiled, SPLIT, num_threads=threads), want)


@needs_native
@needs_tiles
def test_a_slice_past_the_steady_prefetch_bound_computes_the_same() -> None:
    """A thread's slice of more than STEADY_PREFETCH_MAX_BYTES (1 MiB) of tiles streams without
    the tiles' own prefetches: 2,048 rows of Q8_0 are 1.25 MiB, one slice on one thread and two
    shorter ones on two; the bits are the same and the dequantized matmul's."""
    _, tiled, reference = tiled_case(GGMLQuantizationType.Q8_0, 2048, 576)
    assert tiled.blocks.numel() > 1 << 20
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(2))
    long_slice = quantized_linear(x, tiled, SPLIT, num_threads=1)
    assert_close(long_slice, x, reference, SPLIT)
    assert torch.equal(quantized_linear(x, tiled, SPLIT, num_threads=2), long_slice)


@needs_native
@needs_tiles
def test_extreme_values_stay_exact_integers() -> None:
    """Q8_0 at +-127 against activations at their block's maximum: the largest integer sums
    the kernel forms (256 u . q_hi with u = q + 128 up to 255) must not overflow."""
    in_features = 64
    blocks = np.zeros((16, in_features // 32, 34), dtype=np.uint8)
    blocks[:, :, 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    quants = np.where(np.arange(32) % 2 == 0, 127, -128).astype(np.int8)
    blocks[:, :, 2:] = quants.view(np.uint8)
    blocks[8:, :, 2:] = np.full(32, 127, dtype=np.int8).view(np.uint8)
    weight = GGUFBlockWeight.from_blocks(
        torch.from_numpy(blocks.reshape(16, -1)), int(GGMLQuantizationType.Q8_0)
    )
    tiled = weight.tiled_for_kernel()
    assert tiled.tiled
    signs = torch.tensor([1.0, -1.0]).repeat(in_features // 2)
    x = torch.stack((torch.full((in_features,), 3.0), 3.0 * signs, -3.0 * signs))
    reference = cpu_quant_linear.dequantize(weight)
    want = x.double() @ reference.double().T
    torch.testing.assert_close(quantized_linear(x, tiled, SPLIT).double(), want)


@needs_native
@needs_tiles
def test_other_methods_read_a_tiled_weight_in_the_file_layout() -> None:
    weight, tiled, _ = tiled_case(GGMLQuantizationType.Q4_1, 32, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    for method in (QuantLinearMethod.INT8_ACTIVATIONS, QuantLinearMethod.DECODE_TO_FLOAT):
        assert torch.equal(quantized_linear(x, tiled, method), quantized_linear(x, weight, method))
    assert torch.equal(cpu_quant_linear.dequantize(tiled), cpu_quant_linear.dequantize(weight))
    assert torch.equal(
        cpu_quant_linear.widened(tiled, 5, 30), cpu_quant_linear.widened(weight)[5:30]
    )


@needs_native
@needs_tiles
def test_the_kernel_rejects_what_tiles_cannot_be() -> None:
    library = cpu_quant_linear.native_library()
    assert library is not None
    _, tiled, _ = tiled_case(GGMLQuantizationType.Q4_1, 32, 64)
    x = torch.randn(1, 64)
    y = torch.empty(1, 32)
    flag = quant_tiles.TILED_TYPE_FLAG

    def call(kind: int, out_features: int, method: QuantLinearMethod) -> int:
        return int(
            library.tollway_quant_linear(
                tiled.blocks.data_ptr(),
                kind,
                x.data_ptr(),
                y.data_ptr(),
                1,
                out_features,
                64,
                int(method),
                2,
            )
        )

    q4_1, q5_1 = int(GGMLQuantizationType.Q4_1), int(GGMLQuantizationType.Q5_1)
    assert call(q4_1 | flag, 32, SPLIT) == 0
    assert call(q4_1 | flag, 24, SPLIT) == 1  # not whole tiles
    assert call(q5_1 | flag, 32, SPLIT) == 1  # not a tileable type
    assert call(q4_1 | flag, 32, QuantLinearMethod.INT8_ACTIVATIONS) == 1
