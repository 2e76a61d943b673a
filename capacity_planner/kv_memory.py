"""Memory arithmetic: KV cache per token, weights, what a GPU group leaves for the KV cache,
how many streams fit in it, and what each GPU of the fleet holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity_planner.plan_inputs import FleetSpec, ModelSpec, RequestShape
from capacity_planner.plan_step import PlanStep
from capacity_planner.quantity_text import bytes_text as _bytes
from capacity_planner.quantity_text import number_text as _n


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


@dataclass(frozen=True)
class ModelMemory:
    """What the model holds: its weights, and the KV cache of a token and of a whole stream."""

    kv_bytes_per_token: int
    weights_bytes: int
    context_tokens: float
    kv_bytes_per_stream: int
    steps: tuple[PlanStep, ...]


def model_memory(model: ModelSpec, shape: RequestShape) -> ModelMemory:
    m = model.shape
    kv_token = kv_bytes_per_token(model)
    weights = weights_bytes(model)
    context = shape.context_tokens
    kv_stream = math.ceil(context * kv_token)
    steps = (
        PlanStep(
            "kv_bytes_per_token",
            "KV cache per token",
            f"2 × {m.num_layers} layers × {m.num_kv_heads} KV heads × {m.head_dim} head dim × "
            f"{_n(model.kv_bytes_per_element)} B = {_bytes(kv_token)}",
        ),
        PlanStep(
            "weights_bytes",
            "Weights",
            f"{_n(m.num_params)} params × {_n(model.weight_bytes_per_param)} B = {_bytes(weights)}"
            + (f" ({model.weight_format})" if model.weight_format else ""),
        ),
        PlanStep(
            "kv_bytes_per_stream",
            "KV cache per stream",
            f"{_n(context)} tokens of context × {_bytes(kv_token)} = {_bytes(kv_stream)}",
        ),
    )
    return ModelMemory(kv_token, weights, context, kv_stream, steps)


@dataclass(frozen=True)
class GpuMemory:
    """What each GPU holds at its rate: its share of the weights and its streams' KV caches."""

    kv_bytes_per_gpu: int
    memory_bytes_per_gpu: int
    usable_memory_bytes_per_gpu: int
    fits: bool
    steps: tuple[PlanStep, ...]


def gpu_memory(
    fleet: FleetSpec, memory: ModelMemory, streams_per_gpu: float, tensor_parallel: int
) -> GpuMemory:
    context, kv_token, weights = (
        memory.context_tokens,
        memory.kv_bytes_per_token,
        memory.weights_bytes,
    )
    kv_gpu = math.ceil(streams_per_gpu * context * kv_token)
    memory_gpu = math.ceil(weights / tensor_parallel) + kv_gpu
    usable = math.floor(fleet.usable_memory_fraction * fleet.gpu.memory_bytes)
    fits = memory_gpu <= usable
    steps = (
        PlanStep(
            "kv_bytes_per_gpu",
            "KV cache per GPU",
            f"{_n(streams_per_gpu)} streams × {_n(context)} tokens × {_bytes(kv_token)} = "
            f"{_bytes(kv_gpu)}",
        ),
        PlanStep(
            "fits",
            "Memory per GPU",
            f"{_bytes(weights)} / {tensor_parallel} + {_bytes(kv_gpu)} = {_bytes(memory_gpu)} "
            f"{'≤' if fits else '>'} {_n(fleet.usable_memory_fraction)} × "
            f"{_bytes(fleet.gpu.memory_bytes)} = {_bytes(usable)}: "
            f"{'fits' if fits else 'does not fit'}",
        ),
    )
    return GpuMemory(kv_gpu, memory_gpu, usable, fits, steps)
