"""The decode roofline: how long one decode step takes at batch B, and the largest batch that
still gives every stream its speed and fits its KV cache.

A decode step reads every weight once plus each stream's KV cache, and does about two FLOPs
per parameter per stream; it takes whichever is slower::

    step(B) = max((weights_bytes + B * kv_bytes_read_per_stream) / bandwidth,
                  2 * params * B / flops)

Both terms grow with B, so the batch can grow until ``step(B) > 1 / tokens_per_s`` (each
stream gets one token per step) or its KV cache no longer fits. Real engines lose some of this
to kernel launches, attention's own arithmetic and imperfect bandwidth: the roofline is an
upper bound, and ``tollway plan --measure`` replaces it with a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DecodeHardware:
    """What a decode step runs on: one GPU, or a tensor-parallel group taken together."""

    bandwidth_bytes_per_s: float
    flops_per_s: float


@dataclass(frozen=True)
class DecodeLoad:
    weights_bytes: float
    num_params: float
    kv_bytes_read_per_stream: float  # the mean context a stream attends to, in KV bytes


@dataclass(frozen=True)
class DecodeBatch:
    """The largest batch that meets the speed and memory limits, and what it runs at."""

    batch_size: int
    step_seconds: float
    limited_by: Literal["speed", "memory"]

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the whole batch (one per stream per step)."""
        return self.batch_size / self.step_seconds

    @property
    def stream_tokens_per_s(self) -> float:
        return 1 / self.step_seconds


def decode_step_seconds(batch_size: float, load: DecodeLoad, hardware: DecodeHardware) -> float:
    """One decode step at ``batch_size`` streams: memory time or compute time, the slower."""
    bytes_read = load.weights_bytes + batch_size * load.kv_bytes_read_per_stream
    memory_s = bytes_read / hardware.bandwidth_bytes_per_s
    compute_s = 2 * load.num_params * batch_size / hardware.flops_per_s
    return max(memory_s, compute_s)


def largest_batch(
    load: DecodeLoad, hardware: DecodeHardware, *, stream_tokens_per_s: float, max_streams: int
) -> DecodeBatch | None:
    """The largest batch whose step takes at most ``1 / stream_tokens_per_s`` and has at most
    ``max_streams`` streams (what fits in memory); None when not even one stream gets there."""
    step_limit = 1 / stream_tokens_per_s
    by_compute = step_limit * hardware.flops_per_s / (2 * load.num_params)
    spare_bytes = step_limit * hardware.bandwidth_bytes_per_s - load.weights_bytes
    if spare_bytes < 0:
        return None
    by_memory = (
        spare_bytes / load.kv_bytes_read_per_stream
        if load.kv_bytes_read_per_stream > 0
        else math.inf
    )
    by_speed = math.floor(min(by_compute, by_memory, max_streams + 1))
    # Floating point: step back until the step really is within the limit.
    while by_speed > 0 and decode_step_seconds(by_speed, load, hardware) > step_limit:
        by_speed -= 1
    batch_size = min(by_speed, max_streams)
    if batch_size < 1:
        return None
    return DecodeBatch(
        batch_size=batch_size,
        step_seconds=decode_step_seconds(batch_size, load, hardware),
        limited_by="speed" if by_speed <= max_streams else "memory",
    )
