"""What `tollway plan` plans from: traffic, request shape, model and fleet, each checked once.

Field names are the command's option names (``daily_users`` is ``--daily-users``), so a
`ValueError` from here names the option to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity_planner.gpu_presets import GpuSpec
from capacity_planner.model_shape import ModelShape


class PlanError(ValueError):
    """Inputs that are each valid but that no fleet can serve (a model that fits on no
    tensor-parallel group, a speed no GPU reaches); the message says which and by how much."""


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is None:
            continue
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be greater than 0, got {value}")
        if not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def _fraction(owner: object, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(owner, name)
        low_ok = value >= 0 if allow_zero else value > 0
        if not (low_ok and value <= 1):
            low = "0" if allow_zero else "above 0"
            raise ValueError(f"--{name.replace('_', '-')} must be from {low} to 1, got {value}")


@dataclass(frozen=True)
class UserTraffic:
    """Traffic from users: how many a day, the share active in the peak hour, and the share of
    its time an active user has a response streaming."""

    daily_users: float
    peak_active_fraction: float
    in_flight_fraction: float

    def __post_init__(self) -> None:
        _positive(self, "daily_users")
        _fraction(self, "peak_active_fraction", "in_flight_fraction")


@dataclass(frozen=True)
class RequestTraffic:
    """Traffic from requests: how many a day, and the peak rate over the day's mean rate."""

    requests_per_day: float
    peak_factor: float

    def __post_init__(self) -> None:
        _positive(self, "requests_per_day", "peak_factor")
        if self.peak_factor < 1:
            raise ValueError(f"--peak-factor must be at least 1, got {self.peak_factor}")


Traffic = UserTraffic | RequestTraffic


@dataclass(frozen=True)
class RequestShape:
    """Tokens per request (mean, or p50; p90 sizes the KV cache when given), the speed each
    stream must get, and the time-to-first-token target."""

    prompt_tokens: float
    output_tokens: float
    stream_tokens_per_s: float
    ttft_s: float
    prompt_tokens_p90: float | None = None
    output_tokens_p90: float | None = None
    cached_fraction: float = 0.0  # the share of prompt tokens the prefix cache serves

    def __post_init__(self) -> None:
        _positive(self, "prompt_tokens", "output_tokens", "stream_tokens_per_s", "ttft_s")
        _positive(self, "prompt_tokens_p90", "output_tokens_p90")
        _fraction(self, "cached_fraction", allow_zero=True)
        if self.cached_fraction == 1:
            raise ValueError("--cached-fraction must be below 1: some prompt tokens need prefill")

    @property
    def context_tokens(self) -> float:
        """The tokens a stream holds in the KV cache when it ends (p90 where given)."""
        return (self.prompt_tokens_p90 or self.prompt_tokens) + (
            self.output_tokens_p90 or self.output_tokens
        )

    @property
    def mean_decode_context_tokens(self) -> float:
        """The context a decode step attends to, on average over a stream's life."""
        return self.prompt_tokens + self.output_tokens / 2


@dataclass(frozen=True)
class ModelSpec:
    shape: ModelShape
    weight_bytes_per_param: float  # the dtype's, the weight quantization's, or the file's
    kv_bytes_per_element: float
    weight_format: str = ""  # how the weights are held, for the report ("" : not said)

    def __post_init__(self) -> None:
        _positive(self, "weight_bytes_per_param", "kv_bytes_per_element")


@dataclass(frozen=True)
class FleetSpec:
    gpu: GpuSpec
    usable_memory_fraction: float = 0.9  # what the engine may use (weights + KV cache)
    headroom_fraction: float = 0.3  # spare GPUs for failures and spikes
    dollars_per_gpu_hour: float | None = None
    average_utilization: float = 1.0  # the share of its capacity a GPU sells, on average
    max_tensor_parallel: int = 8  # the GPUs one NVLink domain joins
    tensor_parallel: int | None = None  # None: the plan chooses

    def __post_init__(self) -> None:
        _fraction(self, "usable_memory_fraction", "average_utilization")
        _positive(self, "dollars_per_gpu_hour", "max_tensor_parallel", "tensor_parallel")
        if not (self.headroom_fraction >= 0 and math.isfinite(self.headroom_fraction)):
            raise ValueError(f"--headroom-fraction must be 0 or more, got {self.headroom_fraction}")


@dataclass(frozen=True)
class GpuThroughput:
    """A per-GPU output rate from outside the roofline: given, or measured (``--measure``)."""

    output_tokens_per_s: float
    stream_tokens_per_s: float  # what each stream got at that rate
    source: str  # "given" or "measured"

    def __post_init__(self) -> None:
        if not self.output_tokens_per_s > 0:
            raise ValueError(
                f"--gpu-tokens-per-second must be greater than 0, got {self.output_tokens_per_s}"
            )
        _positive(self, "stream_tokens_per_s")


@dataclass(frozen=True)
class PlanInputs:
    traffic: Traffic
    shape: RequestShape
    model: ModelSpec
    fleet: FleetSpec
    gpu_throughput: GpuThroughput | None = None  # None: the roofline's
