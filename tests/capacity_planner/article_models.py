"""The model shapes of the two articles' worked examples, shared by their tests."""

from __future__ import annotations

from capacity_planner.model_shape import ModelShape
from capacity_planner.plan_inputs import ModelSpec

KIB, GIB = 2**10, 2**30


def model(
    layers: int, kv_heads: int, params: float, *, kv_bytes: float = 2, weight_bytes: float = 2
) -> ModelSpec:
    shape = ModelShape(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=128, num_params=int(params),
        source="given",
    )  # fmt: skip
    return ModelSpec(shape, weight_bytes_per_param=weight_bytes, kv_bytes_per_element=kv_bytes)


LLAMA_8B = model(32, 8, 8e9)  # article 1: Llama 3.1 8B, 16-bit
LLAMA_70B = model(80, 8, 70e9)  # article 1: Llama 3.1 70B, 16-bit
CONFIG_A = model(32, 32, 7e9)  # article 2: 7B-class, full multi-head attention, fp16
CONFIG_B = model(80, 8, 70e9)  # article 2: 70B-class, grouped-query attention, fp16
