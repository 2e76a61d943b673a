"""The decode roofline against the articles' figures."""

from __future__ import annotations

import pytest

from capacity_planner.gpu_presets import gpu_preset
from capacity_planner.roofline import (
    DecodeHardware,
    DecodeLoad,
    decode_step_seconds,
    largest_batch,
)

H100 = gpu_preset("h100-80gb")


def test_one_pass_of_16_gb_on_an_h100_takes_about_5_ms() -> None:
    """Article 1: "An 8B model in 16-bit is 16 GB of weights. An NVIDIA H100 reads memory at
    about 3.35 TB a second. So one pass takes at least 16 / 3,350 seconds, about 5 ms. That caps
    one conversation at around 200 tokens a second.\""""
    load = DecodeLoad(weights_bytes=16e9, num_params=8e9, kv_bytes_read_per_stream=0)
    hardware = DecodeHardware(H100.bandwidth_bytes_per_s, H100.flops_per_s)
    step = decode_step_seconds(1, load, hardware)
    assert step == pytest.approx(16 / 3350)  # the bandwidth bound: compute is far below it
    assert round(step * 1000) == 5  # 4.78 ms, to the millisecond
    assert round(1 / step, -2) == 200  # 209 tokens/s, to the hundred


# Article 2's batch table: a 7B model, fp16 (14 GB), full multi-head attention (512 KiB of KV
# per token), 1,000 tokens of context, on "200 TFLOP/s and 2 TB/s".
ARTICLE_2_LOAD = DecodeLoad(
    weights_bytes=14e9, num_params=7e9, kv_bytes_read_per_stream=1000 * 2**19
)
ARTICLE_2_HARDWARE = DecodeHardware(bandwidth_bytes_per_s=2e12, flops_per_s=200e12)


@pytest.mark.parametrize(
    ("batch", "itl_ms", "tokens_per_s"),
    [(1, 7.3, 138), (8, 9.1, 879), (32, 15.4, 2079), (64, 23.8, 2692)],
)
def test_the_batch_size_table_of_article_2(batch: int, itl_ms: float, tokens_per_s: int) -> None:
    """ITL per user to 0.1 ms and total tokens/s to the token, as the article prints them."""
    step = decode_step_seconds(batch, ARTICLE_2_LOAD, ARTICLE_2_HARDWARE)
    assert round(step * 1000, 1) == itl_ms
    assert round(batch / step) == tokens_per_s  # to the token: 137.7 -> 138, 879.4 -> 879


def test_article_2_decode_figures() -> None:
    """ "Batch-1 decode is memory-bound at 7.26 ms per token, and going to batch 64 multiplies
    total throughput roughly 19x while ITL per user only rises from 7 ms to 24 ms"; "ridge =
    100 FLOP per byte"; a 14 GB model on 2 TB/s: "7 ms"."""
    one = decode_step_seconds(1, ARTICLE_2_LOAD, ARTICLE_2_HARDWARE)
    sixty_four = decode_step_seconds(64, ARTICLE_2_LOAD, ARTICLE_2_HARDWARE)
    assert round(one * 1000, 2) == 7.26
    assert int((64 / sixty_four) / (1 / one)) == 19  # 19.5: "roughly 19x" (and "20x" elsewhere)
    assert (round(one * 1000), round(sixty_four * 1000)) == (7, 24)
    assert ARTICLE_2_HARDWARE.flops_per_s / ARTICLE_2_HARDWARE.bandwidth_bytes_per_s == 100
    weights_only = DecodeLoad(14e9, 7e9, kv_bytes_read_per_stream=0)
    assert decode_step_seconds(1, weights_only, ARTICLE_2_HARDWARE) == pytest.approx(0.007)


def test_the_batch_grows_until_the_step_is_slower_than_the_stream_target() -> None:
    # 1 / 42 tokens/s = 23.8 ms: batch 64 takes 23.78 ms, batch 65 takes 24.04 ms.
    batch = largest_batch(
        ARTICLE_2_LOAD, ARTICLE_2_HARDWARE, stream_tokens_per_s=42, max_streams=1000
    )
    assert batch is not None
    assert (batch.batch_size, batch.limited_by) == (64, "speed")
    assert decode_step_seconds(65, ARTICLE_2_LOAD, ARTICLE_2_HARDWARE) > 1 / 42


def test_the_batch_stops_where_the_kv_cache_no_longer_fits() -> None:
    batch = largest_batch(
        ARTICLE_2_LOAD, ARTICLE_2_HARDWARE, stream_tokens_per_s=42, max_streams=29
    )
    assert batch is not None
    assert (batch.batch_size, batch.limited_by) == (29, "memory")
    assert batch.stream_tokens_per_s > 42


def test_compute_bounds_the_step_at_tiny_contexts() -> None:
    """ "Only with tiny contexts does the model become compute-bound": at no KV at all, the
    step at batch B is max(14 GB / 2 TB/s, 2 × 7e9 × B / 200e12), compute from B = 100 (the
    ridge) on."""
    load = DecodeLoad(14e9, 7e9, kv_bytes_read_per_stream=0)
    assert decode_step_seconds(200, load, ARTICLE_2_HARDWARE) == pytest.approx(0.014)
    assert decode_step_seconds(100, load, ARTICLE_2_HARDWARE) == pytest.approx(0.007)


def test_no_batch_when_the_weights_alone_are_too_slow() -> None:
    assert (
        largest_batch(ARTICLE_2_LOAD, ARTICLE_2_HARDWARE, stream_tokens_per_s=200, max_streams=10)
        is None
    )
