"""The quantized-linear kernel's two methods against float32 ``torch.matmul`` of the
dequantized weight, on SmolLM2-135M's linear shapes (``kernels.cpu_quant_linear``).

    python -m bench.quant_linear                 # decode (1 row) and prefill (256 rows)
    python -m bench.quant_linear --rows 1 --calls 50

Each case's time is the median of ``--calls`` calls, the three arms alternating; weights are
random, quantized with the ``gguf`` package. Times in microseconds.
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
    GGUFBlockWeight,
    QuantLinearMethod,
    dequantize,
    quantized_linear,
)

# (out_features, in_features): attention q/o, k/v, MLP gate/up, MLP down
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))
TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)


def median_us(call: Callable[[], object], times: list[float]) -> None:
    start = time.perf_counter()
    call()
    times.append((time.perf_counter() - start) * 1e6)


def run_case(kind: GGMLQuantizationType, shape: tuple[int, int], rows: int, calls: int) -> str:
    rng = np.random.default_rng(0)
    blocks = quants.quantize(rng.standard_normal(shape, dtype=np.float32), kind)
    weight = GGUFBlockWeight.from_blocks(torch.from_numpy(blocks), int(kind))
    dense = dequantize(weight)
    x = torch.randn(rows, shape[1])
    arms: dict[str, Callable[[], object]] = {
        "matmul": lambda: torch.matmul(x, dense.T),
        "float": lambda: quantized_linear(x, weight, QuantLinearMethod.DECODE_TO_FLOAT),
        "int8": lambda: quantized_linear(x, weight, QuantLinearMethod.INT8_ACTIVATIONS),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(3):  # warm up (and build the kernel)
        for call in arms.values():
            call()
    for _ in range(calls):
        for name, call in arms.items():
            median_us(call, times[name])
    cells = "  ".join(f"{name} {statistics.median(t):8.1f}" for name, t in times.items())
    return f"{kind.name:5} rows {rows:3} N {shape[0]:4} K {shape[1]:4}  {cells}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    for rows in args.rows:
        for kind in TYPES:
            for shape in SHAPES:
                print(run_case(kind, shape, rows, args.calls), flush=True)


if __name__ == "__main__":
    main()
