"""The engine's one frozen settings object, built at start-up and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulingMode = Literal["continuous", "static"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know before it loads a model.

    ``kv_cache_memory_bytes`` is the memory budget for the paged KV cache: the
    number of blocks is derived from it and the model's shape, and nothing is
    reserved per request up front.
    """

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    num_kv_blocks: int | None = None  # overrides the memory budget (tests)
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    scheduling: SchedulingMode = "continuous"
    # Fraction of blocks kept free when admitting new requests, so running ones
    # can grow without immediately being preempted (anti-thrashing).
    watermark: float = 0.01
    seed: int = 0
    num_threads: int | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(
                f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}"
            )
