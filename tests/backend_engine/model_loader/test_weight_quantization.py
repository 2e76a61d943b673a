"""Quantizing float weights at load: the Q8_0 / Q4_1 encodings against gguf's dequantizer
(the referee) and the float weight, the CUDA formats holding the same values, which tensors
are quantized, and the float fallback for matrices that are not whole blocks."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from backend_engine.model_loader.weight_quantization import (
    EMBEDDING,
    OUTPUT_PROJECTION,
    quantize_tensor,
    quantize_weights,
    scheme_for,
)
from kernels import quantized_weights
from kernels.cpu_quant_linear import GGUFBlockWeight, GGUFQuantType
from kernels.gptq_quantization import gptq_codes
from kernels.quantized_weights import Int4Weight, Int8Weight, int4_codes, pack_int4
from tests.support.gguf_files import hf_tensors

LINEAR = "model.layers.1.mlp.gate_proj.weight"


def random_weight(num_rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, in_features, generator=gen) * 0.05


def blocks_of(value: object) -> GGUFBlockWeight:
    assert isinstance(value, GGUFBlockWeight)
    return value


def referee(weight: GGUFBlockWeight) -> torch.Tensor:
    """gguf's own dequantization of the blocks."""
    values = gguf.quants.dequantize(weight.blocks.numpy(), Q(int(weight.quant_type)))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(
        weight.out_features, weight.in_features
    )


def block_scales(weight: GGUFBlockWeight) -> torch.Tensor:  # [N, blocks] float16
    raw = weight.blocks.reshape(weight.out_features, weight.in_features // 32, -1)
    return raw[:, :, 0:2].contiguous().view(torch.float16).squeeze(2)


def test_int8_is_q8_0_with_the_rows_scale_in_every_block() -> None:
    weight = random_weight(12, 256)
    blocks = blocks_of(quantize_tensor(LINEAR, weight, "int8", 32, "cpu"))
    assert blocks.quant_type == GGUFQuantType.Q8_0
    assert (blocks.out_features, blocks.in_features) == (12, 256)
    # the scale is amax / 127 rounded to float16 first, and every block of a row carries it
    expected_scale = (weight.abs().amax(dim=1) / 127).half()
    scales = block_scales(blocks)
    assert torch.equal(scales, expected_scale[:, None].expand(12, 8))
    codes = blocks.blocks.reshape(12, 8, 34)[:, :, 2:].contiguous().view(torch.int8)
    codes = codes.reshape(12, 256).float()
    assert torch.equal(codes, torch.round(weight / expected_scale.float()[:, None]))
    assert int(codes.abs().max()) == 127
    # gguf reads back exactly codes * scale, within half a step of the weight
    dequantized = referee(blocks)
    assert torch.equal(dequantized, codes * expected_scale.float()[:, None])
    assert bool(((dequantized - weight).abs() <= expected_scale.float()[:, None] / 2).all())


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_is_q4_1_with_one_scale_and_min_per_group(group_size: int) -> None:
    weight = random_weight(10, 320 if group_size == 32 else 256, seed=1)
    weight[::3] += 0.04  # groups off center, so the minimum matters
    num_rows, in_features = weight.shape
    blocks = blocks_of(quantize_tensor(LINEAR, weight, "int4", group_size, "cpu"))
    assert blocks.quant_type == GGUFQuantType.Q4_1
    raw = blocks.blocks.reshape(num_rows, in_features // 32, 20)  # d, m, 16 bytes of codes
    codes, scales, mins = int4_codes(weight, group_size, torch.float16)
    # a group of 64 is two blocks carrying the same scale and minimum, fitted over all 64
    per_block = group_size // 32
    assert torch.equal(
        raw[:, :, 0:2].contiguous().view(torch.float16).squeeze(2),
        scales.repeat_interleave(per_block, dim=1),
    )
    assert torch.equal(
        raw[:, :, 2:4].contiguous().view(torch.float16).squeeze(2),
        mins.repeat_interleave(per_block, dim=1),
    )
    # value j of a block in byte j's low half-byte, value j + 16 in its high one
    block_codes = codes.reshape(num_rows, -1, 32)
    assert torch.equal(raw[:, :, 4:] & 15, block_codes[:, :, :16])
    assert torch.equal(raw[:, :, 4:] >> 4, block_codes[:, :, 16:])
    # gguf reads back exactly what our own dequantize gives for those codes
    ours = Int4Weight(pack_int4(codes), scales, mins, group_size)
    assert torch.equal(referee(blocks), quantized_weights.dequantize(ours))


@pytest.mark.parametrize("group_size", [32, 64])
def test_gptq_int4_is_the_same_q4_1_blocks_gguf_reads_back(group_size: int) -> None:
    weight = random_weight(10, 256, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 64, generator=gen) @ torch.randn(64, 256, generator=gen)  # correlated
    hessian = 2 * x.T @ x / 300
    blocks = blocks_of(quantize_tensor(LINEAR, weight, "int4", group_size, "cpu", hessian))
    assert blocks.quant_type == GGUFQuantType.Q4_1
    codes, scales, mins = gptq_codes(weight, hessian, group_size, torch.float16)
    ours = Int4Weight(pack_int4(codes), scales, mins, group_size)
    assert torch.equal(referee(blocks), quantized_weights.dequantize(ours))  # bit-exact
    rtn = blocks_of(quantize_tensor(LINEAR, weight, "int4", group_size, "cpu"))
    assert not torch.equal(rtn.blocks, blocks.blocks)  # the Hessian was used
    # the CUDA format holds the same values
    cuda_format = quantize_tensor(LINEAR, weight, "int4", group_size, "cuda", hessian)
    assert isinstance(cuda_format, Int4Weight)
    assert torch.equal(quantized_weights.dequantize(cuda_format), referee(blocks))


def test_hessians_reach_only_the_int4_tensors_they_name() -> None:
    weight = random_weight(8, 64, seed=6)
    hessian = torch.eye(64) * 2
    other = "model.layers.0.mlp.up_proj.weight"
    stream = [(LINEAR, weight), (other, weight), (OUTPUT_PROJECTION, weight)]
    with_hessian = dict(quantize_weights(stream, "int4", 32, "cpu", hessians={LINEAR: hessian}))
    without = dict(quantize_weights(stream, "int4", 32, "cpu"))
    assert blocks_of(with_hessian[other]).blocks.equal(blocks_of(without[other]).blocks)
    assert blocks_of(with_hessian[OUTPUT_PROJECTION]).quant_type == GGUFQuantType.Q8_0
    assert blocks_of(with_hessian[LINEAR]).quant_type == GGUFQuantType.Q4_1


def block_errors(dequantized: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (dequantized - weight).pow(2).reshape(-1, 32).sum(dim=1)  # [blocks]


def test_int4_group_32_beats_ggmls_q4_1_block_by_block() -> None:
    """gguf's Q4_1 quantizer is min/max rounding (codes against the unrounded scale); the
    search keeps that candidate, so no block of ours reads back worse, and most read back
    better."""
    weight = random_weight(64, 256, seed=2)
    weight[::2] = weight[::2].abs()  # half the rows one-sided
    ours = blocks_of(quantize_tensor(LINEAR, weight, "int4", 32, "cpu"))
    ggml_blocks = gguf.quants.quantize(weight.numpy(), Q.Q4_1).reshape(64, -1)
    ggml = GGUFBlockWeight(torch.from_numpy(ggml_blocks), GGUFQuantType.Q4_1, 64, 256)
    ours_error = block_errors(referee(ours), weight)
    ggml_error = block_errors(referee(ggml), weight)
    assert bool((ours_error <= ggml_error * (1 + 1e-6)).all())
    assert float(ours_error.sum()) < 0.9 * float(ggml_error.sum())


@pytest.mark.parametrize(("quantization", "group_size"), [("int8", 32), ("int4", 32), ("int4", 64)])
def test_the_cuda_formats_hold_the_cpu_blocks_values(quantization: str, group_size: int) -> None:
    weight = random_weight(6, 192, seed=3)
    cpu = blocks_of(quantize_tensor(LINEAR, weight, quantization, group_size, "cpu"))
    cuda = quantize_tensor(LINEAR, weight, quantization, group_size, "cuda")
    expected_type = Int8Weight if quantization == "int8" else Int4Weight
    assert isinstance(cuda, expected_type)
    assert cuda.scales.dtype == torch.float16
    if isinstance(cuda, Int4Weight):
        assert cuda.mins.dtype == torch.float16
    assert torch.equal(quantized_weights.dequantize(cuda), referee(cpu))


def test_which_tensors_are_quantized() -> None:
    tensors = {name: torch.from_numpy(v) for name, v in hf_tensors(bias=True).items()}
    # hf_tensors' hidden size (64) and FFN (128) are whole groups of 64
    for device_type in ("cpu", "cuda"):
        for quantization in ("int8", "int4"):
            out = dict(quantize_weights(tensors.items(), quantization, 64, device_type))
            assert out.keys() == tensors.keys()
            for name, value in out.items():
                scheme = scheme_for(name, quantization, device_type)
                if name.endswith(("_proj.weight",)):
                    assert scheme == quantization, name
                elif name == OUTPUT_PROJECTION:
                    assert scheme == "int8"
                elif name == EMBEDDING:
                    assert scheme == ("int8" if device_type == "cpu" else None)
                else:  # norms and biases
                    assert scheme is None, name
                if scheme is None:
                    assert value is tensors[name]
                elif device_type == "cpu":
                    kind = GGUFQuantType.Q8_0 if scheme == "int8" else GGUFQuantType.Q4_1
                    assert blocks_of(value).quant_type == kind, name
                else:
                    assert isinstance(value, Int8Weight if scheme == "int8" else Int4Weight)


def test_a_matrix_of_partial_blocks_stays_float(caplog: pytest.LogCaptureFixture) -> None:
    odd = random_weight(4, 96, seed=4)  # three blocks of 32, one and a half groups of 64
    with caplog.at_level(logging.WARNING):
        assert quantize_tensor(LINEAR, odd, "int4", 64, "cpu") is odd
        assert quantize_tensor(LINEAR, odd, "int4", 64, "cuda") is odd
    assert (
        caplog.messages
        == [f"{LINEAR}: in_features 96 is not a multiple of 64, so it stays float32 (not int4)"] * 2
    )
    assert blocks_of(quantize_tensor(LINEAR, odd, "int4", 32, "cpu")).in_features == 96
    ragged = random_weight(4, 100, seed=5)
    assert quantize_tensor(OUTPUT_PROJECTION, ragged, "int8", 32, "cpu") is ragged
    # the CUDA int8 format has no blocks: any width
    assert isinstance(quantize_tensor(OUTPUT_PROJECTION, ragged, "int8", 32, "cuda"), Int8Weight)


def test_zero_rows_stay_zero() -> None:
    weight = torch.zeros(3, 64)
    for quantization in ("int8", "int4"):
        blocks = blocks_of(quantize_tensor(LINEAR, weight, quantization, 64, "cpu"))
        assert torch.equal(referee(blocks), weight)


def test_bfloat16_weights_quantize_as_their_float32_values() -> None:
    weight = random_weight(4, 64, seed=6).bfloat16()
    from_bf16 = blocks_of(quantize_tensor(LINEAR, weight, "int4", 32, "cpu"))
    from_f32 = blocks_of(quantize_tensor(LINEAR, weight.float(), "int4", 32, "cpu"))
    assert torch.equal(from_bf16.blocks, from_f32.blocks)


def test_the_progress_bar_changes_nothing() -> None:
    tensors = {name: torch.from_numpy(v) for name, v in hf_tensors().items()}
    quiet = list(quantize_weights(tensors.items(), "int4", 32, "cpu"))
    shown = list(quantize_weights(tensors.items(), "int4", 32, "cpu", show_progress=True))
    assert [name for name, _ in quiet] == [name for name, _ in shown]
    for (_, a), (_, b) in zip(quiet, shown, strict=True):
        if isinstance(a, GGUFBlockWeight):
            assert isinstance(b, GGUFBlockWeight)
            assert torch.equal(a.blocks, b.blocks)
        else:
            assert a is b


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("int3", 32, "cpu"), "quantization must be one of"),
        (("int4", 48, "cpu"), "group_size must be one of"),
        (("int8", 32, "mps"), "device_type must be one of"),
    ],
)
def test_bad_settings_are_refused(args: tuple[str, int, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        list(quantize_weights([], *args))
