"""Per-request sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_engine.structured_output.constraint import OutputConstraint

# What the sampler can run: torch.Generator.manual_seed takes -2**63 .. 2**64 - 1 (a
# negative seed is its two's complement), and top_k becomes an int64 tensor.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_TOP_K = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` turn those
    filters off. ``logprobs`` asks for that many top alternatives per sampled token
    (the sampled token's own log-probability is always reported when it is set).
    ``structured_output``: what the output must match (a JSON Schema, a regex...); each
    token is then sampled among those the grammar allows, and logprobs are of that choice.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: OutputConstraint | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, 2**63 - 1] (0 disables it), got {self.top_k}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        # Frozen, so normalise through object.__setattr__.
        object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
