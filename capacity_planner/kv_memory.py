"""Memory arithmetic: KV cache per token, weights, what a GPU group leaves for the KV cache,
and how many streams fit in it."""

from __future__ import annotations

import math

from capacity_planner.plan_inputs import FleetSpec, ModelSpec


def kv_bytes_per_token(model: ModelSpec) -> int:
    """2 (key and value) × layers × KV heads × head dimension × bytes per element."""
    shape = model.shape
    size = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * model.kv_bytes_per_element
    return math.ceil(size)


def weights_bytes(model: ModelSpec) -> int:
    return math.ceil(model.shape.num_params * model.weight_bytes_per_param)


def free_kv_bytes(fleet: FleetSpec, weights: float, tensor_parallel: int = 1) -> float:
    """What a tensor-parallel group leaves for the KV cache: usable memory less the weights."""
    return tensor_parallel * fleet.usable_memory_fraction * fleet.gpu.memory_bytes - weights


def streams_that_fit(free_bytes: float, context_tokens: float, kv_per_token: float) -> int:
    """Whole streams of ``context_tokens`` whose KV cache fits in ``free_bytes``."""
    return max(0, math.floor(without_float_noise(free_bytes / (context_tokens * kv_per_token))))


def without_float_noise(value: float) -> float:
    """``value`` with floating-point noise removed, so a ratio that is whole stays whole."""
    return round(value, 9)
