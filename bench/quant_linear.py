"""The quantized-linear kernel's methods against float32 ``torch.matmul`` of the
dequantized weight, on SmolLM2-135M's linear shapes (``kernels.cpu_quant_linear``).

    python -m bench.quant_linear                 # decode (1 row) and prefill (256 rows)
    python -m bench.quant_linear --rows 1 4 16 --types Q4_1 Q8_0
    python -m bench.quant_linear --rows 1 --calls 50 --types Q4_1 Q4_K Q6_K

Arms: ``matmul`` (float32, the dequantized weight), ``float`` (DECODE_TO_FLOAT), ``int8``
(INT8_ACTIVATIONS), ``split`` (INT8_SPLIT_ACTIVATIONS on the file's rows), ``tiled`` (the
same method on the weight in tiles, where the type and kernel allow: the engine's default
there) and ``widened`` (the untiled default from ``WIDEN_MIN_ROWS`` rows: slices widened for
oneDNN). Each case's time is the median of ``--calls`` calls, the arms alternating; weights are
random, quantized with the ``gguf`` package where it has a quantizer (random blocks with sane
scales otherwise: the super-block types). The super-block types need in_features % 256 == 0, so
their in_features is rounded up to it (576 -> 768). Times in microseconds; ``GB/s`` is the
weight's bytes over the tiled arm's time (the int8 arm's where there is none), the figure to
compare across types at one row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from kernels.cpu_quant_linear import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    WIDEN_MIN_ROWS,
    GGUFBlockWeight,
    GGUFQuantType,
    QuantLinearMethod,
    dequantize,
    quantized_linear,
)

# (out_features, in_features): attention q/o, k/v, MLP gate/up, MLP down
# and the output projection (vocabulary, hidden)
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))
DEFAULT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# where each type's fp16 scales sit in its block (the super-block types' random blocks)
SCALE_OFFSETS = {GGUFQuantType.Q4_K: (0, 2), GGUFQuantType.Q5_K: (0, 2), GGUFQuantType.Q6_K: (208,)}


def random_weight(kind: GGUFQuantType, shape: tuple[int, int]) -> GGUFBlockWeight:
    rng = np.random.default_rng(0)
    if kind not in SCALE_OFFSETS:
        dense = rng.standard_normal(shape, dtype=np.float32)
        blocks = quants.quantize(dense, GGMLQuantizationType(int(kind)))
        return GGUFBlockWeight.from_blocks(torch.from_numpy(blocks), int(kind))
    num_blocks = shape[1] // BLOCK_VALUES[kind]
    raw = rng.integers(0, 256, (shape[0], num_blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scale = rng.uniform(0.0, 0.01, (shape[0], num_blocks, 1)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8)
    return GGUFBlockWeight.from_blocks(torch.from_numpy(raw.reshape(shape[0], -1)), int(kind))


def median_us(call: Callable[[], object], times: list[float]) -> None:
    start = time.perf_counter()
    call()
    times.append((time.perf_counter() - start) * 1e6)


def run_case(kind: GGUFQuantType, shape: tuple[int, int], rows: int, calls: int) -> str:
    values = BLOCK_VALUES[kind]
    shape = (shape[0], -(-shape[1] // values) * values)
    weight = random_weight(kind, shape)
    dense = dequantize(weight)
    x = torch.randn(rows, shape[1])
    split = QuantLinearMethod.INT8_SPLIT_ACTIVATIONS
    tiled = weight.tiled_for_kernel()
    arms: dict[str, Callable[[], object]] = {
        "matmul": lambda: torch.matmul(x, dense.T),
        "float": lambda: quantized_linear(x, weight, QuantLinearMethod.DECODE_TO_FLOAT),
        "int8": lambda: quantized_linear(x, weight, QuantLinearMethod.INT8_ACTIVATIONS),
        "split": lambda: quantized_linear(x, weight, split),
    }
    if tiled.tiled:
        arms["tiled"] = lambda: quantized_linear(x, tiled, split)
    if rows >= WIDEN_MIN_ROWS:
        arms["widened"] = lambda: quantized_linear(x, weight)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(3):  # warm up (and build the kernel)
        for call in arms.values():
            call()
    for _ in range(calls):
        for name, call in arms.items():
            median_us(call, times[name])
    cells = "  ".join(f"{name} {statistics.median(t):8.1f}" for name, t in times.items())
    fastest = "tiled" if "tiled" in times else "int8"
    gigabytes_per_s = weight.blocks.numel() / statistics.median(times[fastest]) / 1e3
    return (
        f"{kind.name:5} rows {rows:3} N {shape[0]:4} K {shape[1]:4}  {cells}"
        f"  GB/s ({fastest}) {gigabytes_per_s:5.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument(
        "--types", nargs="+", default=DEFAULT_TYPES, choices=[kind.name for kind in GGUFQuantType]
    )
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    for rows in args.rows:
        for kind in (GGUFQuantType[name] for name in args.types):
            for shape in SHAPES:
                print(run_case(kind, shape, rows, args.calls), flush=True)


if __name__ == "__main__":
    main()
