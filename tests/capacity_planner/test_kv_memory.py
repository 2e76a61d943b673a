"""The articles' KV-cache, weight and free-memory figures, reproduced by the formulas: the
inputs are the article's, the expected value is what the article prints, and where the
article rounds, the test rounds the same way and says how.

Article 1: "How LLM inference works". Article 2: "inference fundamentals for system design"
(configurations A and B).
"""

from __future__ import annotations

import math

import pytest

from capacity_planner.gpu_presets import GB, GpuSpec, gpu_preset
from capacity_planner.kv_memory import (
    free_kv_bytes,
    kv_bytes_per_token,
    streams_that_fit,
    weights_bytes,
)
from capacity_planner.plan_inputs import FleetSpec
from tests.capacity_planner.article_models import (
    CONFIG_A,
    CONFIG_B,
    GIB,
    KIB,
    LLAMA_8B,
    LLAMA_70B,
    model,
)

H100 = gpu_preset("h100-80gb")


# --- KV cache per token ------------------------------------------------------------------


def test_kv_per_token_for_llama_8b_and_70b_article_1() -> None:
    # "128 KB" and "320 KB" per token (the article's KB are KiB: 131,072 and 327,680 bytes).
    assert kv_bytes_per_token(LLAMA_8B) / KIB == 128
    assert kv_bytes_per_token(LLAMA_70B) / KIB == 320
    # "An 8,000-token conversation": 1 GB and 2.5 GB (8,000 × 128 KiB = 1.05e9 B, rounded to
    # a whole GB; 8,000 × 320 KiB = 2.62e9 B, rounded to the half GB).
    assert round(8000 * kv_bytes_per_token(LLAMA_8B) / GB) == 1
    assert round(8000 * kv_bytes_per_token(LLAMA_70B) / GB * 2) / 2 == 2.5
    # "Without it [GQA], the 70B model would need 2.5 MB per token": 64 KV heads.
    assert kv_bytes_per_token(model(80, 64, 70e9)) / 2**20 == 2.5
    # "A 128,000-token conversation on the 8B model holds 16 GB of cache": the article
    # multiplies 128,000 × 128 KB = 16.4 million KB and calls it 16 GB (KB = KiB, 1e6 KB = GB).
    assert math.floor(128_000 * kv_bytes_per_token(LLAMA_8B) / KIB / 1e6) == 16
    # "At 128 KB per token, one conversation [of 1 million tokens] needs 128 GB", same units.
    assert 1_000_000 * kv_bytes_per_token(LLAMA_8B) / KIB / 1e6 == 128


def test_kv_per_token_for_configurations_a_and_b_article_2() -> None:
    # A) 2 * 32 * 32 * 128 * 2 = 524,288 B = 512 KiB; B) 2 * 80 * 8 * 128 * 2 = 327,680 B.
    assert kv_bytes_per_token(CONFIG_A) == 524_288 == 512 * KIB
    assert kv_bytes_per_token(CONFIG_B) == 327_680 == 320 * KIB
    # 4,096- and 32,768-token sequences: 2.0 / 16.0 GiB (A) and 1.25 / 10.0 GiB (B), exact.
    assert [n * kv_bytes_per_token(CONFIG_A) / GIB for n in (4096, 32768)] == [2.0, 16.0]
    assert [n * kv_bytes_per_token(CONFIG_B) / GIB for n in (4096, 32768)] == [1.25, 10.0]
    # "int8 KV cache halves both (256 / 160 KiB per token)."
    assert kv_bytes_per_token(model(32, 32, 7e9, kv_bytes=1)) / KIB == 256
    assert kv_bytes_per_token(model(80, 8, 70e9, kv_bytes=1)) / KIB == 160


# --- weights and free memory -------------------------------------------------------------


def test_weights_article_1() -> None:
    # "16 GB for an 8 billion parameter model in 16-bit", "its weights alone are 140 GB",
    # "At 8-bit, the 8B model is 8 GB".
    assert weights_bytes(LLAMA_8B) == 16 * GB
    assert weights_bytes(LLAMA_70B) == 140 * GB
    assert weights_bytes(model(32, 8, 8e9, weight_bytes=1)) == 8 * GB


def test_free_memory_article_1() -> None:
    """ "An H100 has 80 GB. The 8B model takes 16 GB. The other 64 GB holds about 500,000 tokens
    of KV cache. That is 60 conversations of 8,000 tokens, or 250 of 2,000.\""""
    fleet = FleetSpec(H100, usable_memory_fraction=1.0)
    free = free_kv_bytes(fleet, weights_bytes(LLAMA_8B))
    assert free == 64 * GB
    tokens = streams_that_fit(free, 1, kv_bytes_per_token(LLAMA_8B))
    assert tokens == 488_281
    # The article rounds to one significant figure ...
    rounded = round(tokens, -5)
    assert rounded == 500_000
    # ... and divides the rounded figure: 62.5 conversations of 8,000 is "60" (one
    # significant figure), 250 of 2,000 is exact.
    assert round(rounded / 8000, -1) == 60
    assert rounded / 2000 == 250
    # The 70B model "doesn't fit on one H100 at 16-bit": it needs a group of two or more.
    assert free_kv_bytes(fleet, weights_bytes(LLAMA_70B)) < 0
    assert free_kv_bytes(fleet, weights_bytes(LLAMA_70B), tensor_parallel=2) > 0


def test_free_memory_article_2() -> None:
    """ "free = 80*0.9 - 14 = 58 GiB; per sequence = 2 GiB (config A) -> 29 sequences\""""
    gpu = GpuSpec("80 GiB", 80 * GIB, 2e12, 200e12, source="article 2")
    fleet = FleetSpec(gpu, usable_memory_fraction=0.9)
    free = free_kv_bytes(fleet, 14 * GIB)
    assert free / GIB == pytest.approx(58)
    assert streams_that_fit(free, 4096, kv_bytes_per_token(CONFIG_A)) == 29
    # The same 58 GiB at 1,000 tokens of context: "the KV cache, not compute, stops the batch
    # (118 sequences), and GQA lifts that to 475" (GQA: 8 KV heads instead of 32).
    assert streams_that_fit(free, 1000, kv_bytes_per_token(CONFIG_A)) == 118
    assert streams_that_fit(free, 1000, kv_bytes_per_token(model(32, 8, 7e9))) == 475


def test_continuous_batching_demo_article_1() -> None:
    """ "The GPU has 24 GB: 16 GB for an 8B model's weights, and 8 GB (about 64,000 tokens)
    for the KV cache ... add a 30,000-token request and watch it take half the cache.\""""
    gpu = GpuSpec("24 GiB", 24 * GIB, 1e12, 1e14, source="article 1")
    free = free_kv_bytes(FleetSpec(gpu, usable_memory_fraction=1.0), 16 * GIB)
    tokens = streams_that_fit(free, 1, kv_bytes_per_token(LLAMA_8B))
    assert tokens == 64 * KIB  # 65,536: "about 64,000" (64 Ki)
    assert round(30_000 / tokens, 1) == 0.5  # 0.46 of the cache: "half"
