"""Per-request sampling settings."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from backend_engine.structured_output.constraint import OutputConstraint

# What the sampler can run: torch.Generator.manual_seed takes -2**63 .. 2**64 - 1 (a
# negative seed is its two's complement), and top_k becomes an int64 tensor.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_TOP_K = 2**63 - 1
MAX_N = 128  # choices per request
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's bound
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0  # presence and frequency: OpenAI's [-2, 2]
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` turn those
    filters off. ``logprobs`` asks for that many top alternatives per sampled token
    (the sampled token's own log-probability is always reported when it is set).
    ``structured_output``: what the output must match (a JSON Schema, a regex...); each
    token is then sampled among those the grammar allows, and logprobs are of that choice.

    ``n``: how many choices to generate from the one prompt. The prompt is prefilled once and
    its KV blocks shared; each choice then decodes as its own sequence. With ``seed``, choice
    ``i`` draws from a generator seeded from ``(seed, i)`` (`choice_seed`), choice 0 from
    ``seed`` itself.

    The logits stage, before greedy choice, sampling and logprobs alike (OpenAI's formulas):
    ``logit_bias`` adds its bias to each listed token id; ``presence_penalty`` subtracts
    itself from every token generated so far, ``frequency_penalty`` itself times the token's
    count; ``repetition_penalty`` (transformers' formula, over prompt and output) divides a
    seen token's positive logit by it and multiplies a negative one. Their neutral values
    (0, 0, 1, ``{}``) cost nothing.

    ``prompt_logprobs``: the log-probability of each prompt token given those before it (the
    first has none) and that many top alternatives, computed during prefill; such a request
    is prefilled whole, never read from the prefix cache.
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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    prompt_logprobs: int | None = None

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
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}"
            )
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} token ids, "
                f"got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}"
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for {token_id}"
                )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        # Frozen, so normalise through object.__setattr__.
        object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        object.__setattr__(
            self, "logit_bias", {int(t): float(b) for t, b in self.logit_bias.items()}
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the penalties need the tokens seen so far (bias alone does not)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Whether the logits stage changes this request's logits at all."""
        return self.has_penalties or bool(self.logit_bias)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a seeded request with ``n`` > 1: ``seed`` itself for
    choice 0 (so ``n=1`` and the first of ``n`` agree), a mix of both for the others, in the
    range `torch.Generator.manual_seed` takes."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (MAX_SEED + 1)
