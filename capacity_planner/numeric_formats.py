"""Bytes per stored number, by format name: weights, quantized weights and KV-cache entries."""

from __future__ import annotations

BYTES_PER_ELEMENT: dict[str, float] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": 1,  # per-channel scales: a few bytes per row, negligible
    # 4-bit codes plus a float16 scale and minimum per group of 32 (the engine's int4 at its
    # default group size: Q4_1's 20-byte block on the CPU, the same bytes in Triton's format)
    "int4": 0.625,
}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def bytes_per_element(name: str) -> float:
    """The size of one number stored as ``name``; a `ValueError` naming the formats if unknown."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown number format {name!r}; formats: {', '.join(BYTES_PER_ELEMENT)}")
    return BYTES_PER_ELEMENT[key]
