"""The quantized-linear case of ``bench.kernels_gpu``: Triton int8/int4 weight-only matmuls
against a float16 ``torch`` matmul of the same weight dequantized.

    python -m bench.kernels_gpu --skip store_kv --skip decode --skip prefill

Decode (one row) is memory bound: the figure of merit is the bytes read (weight codes,
scales, int4 mins, activations) per second, against the float16 matmul reading 2 bytes a weight.
Prefill (512 rows) shows what the in-kernel widening costs once the matmul is compute bound.
``err`` is the largest |Triton - reference| (dequantize, float32 matmul) difference.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels_gpu import time_ms
from kernels.quantized_weights import (
    Int8Weight,
    QuantizedWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
    reference_linear,
)

# (model, layer, out_features N, in_features K)
LINEAR_SHAPES = [
    ("SmolLM2-135M", "up", 1536, 576),
    ("SmolLM2-135M", "down", 576, 1536),
    ("8B", "qkv", 6144, 4096),
    ("8B", "gate_up", 28672, 4096),
    ("8B", "down", 4096, 14336),
]
NUM_ROWS = [1, 512]  # decode, prefill
FORMATS = ["int8", "int4-g32", "int4-g64"]


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """``fmt``'s weight with float16 scales (and int4 mins): what a served model would keep."""
    if fmt == "int8":
        int8 = quantize_int8(weight)
        return Int8Weight(int8.qweight, int8.scales.half())
    group_size = int(fmt.removeprefix("int4-g"))
    return quantize_int4(weight, group_size, torch.float16)


def weight_bytes(weight: QuantizedWeight) -> int:
    if isinstance(weight, Int8Weight):
        return weight.qweight.nbytes + weight.scales.nbytes
    return weight.packed.nbytes + weight.scales.nbytes + weight.mins.nbytes


def bench_quant_linear(args: argparse.Namespace) -> None:
    print("\n## quantized linear  float16 activations, float16 scales")
    print(
        f"{'model':>13} {'layer':>8} {'N':>6} {'K':>6} {'rows':>5} {'format':>9} {'MB read':>8} "
        f"{'ms':>8} {'GB/s':>7} {'% peak':>7} {'fp16 ms':>8} {'fp16 GB/s':>9} {'speedup':>7} "
        f"{'err':>9}"
    )
    for model, layer, out_features, in_features in LINEAR_SHAPES:
        weight = torch.randn(out_features, in_features, device="cuda") * in_features**-0.5
        for num_rows in NUM_ROWS:
            x = torch.randn(num_rows, in_features, device="cuda", dtype=torch.float16)
            for fmt in FORMATS:
                print(
                    f"{model:>13} {layer:>8} {out_features:>6} {in_features:>6} {num_rows:>5} "
                    f"{fmt:>9} {quant_linear_row(quantize(weight, fmt), x, args)}"
                )
            torch.cuda.empty_cache()


def quant_linear_row(
    weight: QuantizedWeight,
    x: torch.Tensor,  # [num_rows, in_features] float16
    args: argparse.Namespace,
) -> str:
    from kernels.triton_quant_linear import quantized_linear

    dense = dequantize(weight).half()  # [N, K], what the float16 matmul reads
    ms = time_ms(lambda: quantized_linear(x, weight), args.repeats)
    fp16_ms = time_ms(lambda: x @ dense.T, args.repeats)
    err = (quantized_linear(x, weight).float() - reference_linear(x, weight).float()).abs()
    io_bytes = x.nbytes + x.shape[0] * weight.out_features * 2  # activations in, outputs out
    read = weight_bytes(weight) + io_bytes
    gbps = read / (ms * 1e-3) / 1e9
    fp16_gbps = (dense.nbytes + io_bytes) / (fp16_ms * 1e-3) / 1e9
    return (
        f"{read / 1e6:>8.2f} {ms:>8.3f} {gbps:>7.0f} {100 * gbps / args.peak_gbps:>6.1f}% "
        f"{fp16_ms:>8.3f} {fp16_gbps:>9.0f} {fp16_ms / ms:>6.2f}x {err.max().item():>9.2e}"
    )
