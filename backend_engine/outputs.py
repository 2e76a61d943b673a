"""Values the engine hands back to its callers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

# "error": this request's own work failed in the engine (``error`` says how); the
# requests batched with it went on.
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class RequestOutputDelta:
    """One increment of a streamed request: what is new since the last delta.

    ``new_text`` never ends in the middle of a UTF-8 character and never contains
    (a prefix of) a stop string that might still complete. The last delta of a
    request has ``finished`` set and a ``finish_reason``.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int | None  # prompt tokens found in the prefix cache; None until admitted
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None  # with finish_reason "error": what failed
    index: int = 0  # which of the request's ``n`` choices this delta belongs to
    # With ``prompt_logprobs``, on a choice's first delta: one entry per prompt token, the
    # first None (nothing comes before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The whole result of one request, as ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int | None  # None: it never reached the prefix cache (e.g. it failed first)
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # with finish_reason "error": what failed
    index: int = 0  # which of the request's ``n`` choices
    prompt_logprobs: list[TokenLogprob | None] | None = None


# Seconds a request waited before it was first scheduled (the histogram's upper bounds).
QUEUE_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class QueueTimes:
    """Queue times of the requests of one priority class, cumulative: how many fell in each
    of `QUEUE_TIME_BUCKETS` (not cumulative across buckets; the last entry counts those past
    the largest bound) and their sum."""

    counts: tuple[int, ...] = (0,) * (len(QUEUE_TIME_BUCKETS) + 1)
    sum_s: float = 0.0


@dataclass(frozen=True)
class SpeculativeCounts:
    """One proposer's work since the engine started (cumulative)."""

    num_verified_chunks: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0  # drafts scored by the target
    num_accepted_tokens: int = 0  # drafts the target kept

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def accepted_tokens_per_chunk(self) -> float:
        """Drafts kept per verifying step of a sequence (it emits one more of its own)."""
        if not self.num_verified_chunks:
            return 0.0
        return self.num_accepted_tokens / self.num_verified_chunks


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics."""

    num_kv_blocks_total: int
    num_kv_blocks_used: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    num_waiting: int
    num_running: int
    num_prompt_tokens: int  # each prefilled request's prompt, at its first token (cumulative)
    num_generation_tokens: int  # tokens generated, cumulative
    num_requests: int = 0  # requests queued, cumulative
    # Prompt tokens whose KV was computed, cumulative: prefix-cache hits and the choices forked
    # off a leader's prefill (``n`` > 1) add nothing; a recompute after preemption adds again.
    num_computed_prompt_tokens: int = 0
    # Per priority class ("interactive", "batch"): how long requests waited to be scheduled.
    queue_times: Mapping[str, QueueTimes] = field(default_factory=dict)
    # Speculative decoding, by proposer ("ngram"): drafts scored and kept (cumulative).
    speculative: Mapping[str, SpeculativeCounts] = field(default_factory=dict)
