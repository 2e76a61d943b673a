"""Speculative decoding in the runner: one chunk's drafts checked against the target's rows.

A chunk with drafts (``ScheduledRequest.draft_token_ids``) computes its last token and its k
drafts in one forward pass, giving k + 1 rows of raw logits: row i is the target's view after
the drafts before i. Each row must be the distribution the request would sample from had the
drafts before it been sampled one by one, so it goes through the same stage a decode row does:

1. The logits stage (``logit_bias``, penalties): row i's history is the request's tokens plus
   the first i drafts.
2. A structured output's mask: row i's grammar state is the matcher after the first i drafts.
   Drafts the grammar refuses are cut off first (they could never be kept); the matcher walks
   the rest to mask each row, then rolls back, and finally accepts only the tokens emitted.
3. Greedy or rejection-sampling verification (:mod:`backend_engine.speculative.verification`),
   against the same temperature, top-k and top-p the sampler draws with
   (:func:`~backend_engine.worker.sampler.sampling_probs`); a seeded request draws from its
   own generator.

Logprobs, where asked for, are the target's for each emitted token, from its processed row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend_engine.core.scheduler_output import ScheduledRequest
from backend_engine.core.step_runner import SampledToken
from backend_engine.outputs import TokenLogprob
from backend_engine.sampling_params import SamplingParams
from backend_engine.speculative.verification import VerifiedTokens, verify_greedy, verify_sampled
from backend_engine.worker.logits_mask import mask_logits
from backend_engine.worker.logits_processing import apply_logits_stage
from backend_engine.worker.sampler import sampling_probs, token_logprobs


@dataclass(frozen=True)
class _DraftRow:
    """What the logits stage reads for row i: the request's tokens and the first i drafts."""

    sampling_params: SamplingParams
    all_token_ids: Sequence[int]
    num_prompt_tokens: int


def verify_drafts(
    logits: torch.Tensor,  # [k + 1, vocab]: the raw rows of the chunk's last token and drafts
    item: ScheduledRequest,
    generator: torch.Generator,
) -> SampledToken:
    """The tokens the chunk emits: the drafts kept (``accepted_drafts``) and the target's own
    token after them. Raises what the request's own grammar or settings raise."""
    drafts = list(item.draft_token_ids)
    params = item.sampling_params
    matcher = item.matcher
    if matcher is not None:
        drafts = drafts[: matcher.num_valid_prefix(drafts)]
    logits = logits[: len(drafts) + 1]
    if params.processes_logits:
        history = list(item.all_token_ids)
        rows = [
            _DraftRow(params, history + drafts[:i], item.num_prompt_tokens)
            for i in range(len(drafts) + 1)
        ]
        apply_logits_stage(logits, rows)
    if matcher is not None:
        for i in range(len(drafts) + 1):
            failure = mask_logits(logits[i : i + 1], {0: matcher}).get(0)
            if failure is not None:
                matcher.rollback(i)
                raise failure
            if i < len(drafts):
                matcher.accept(drafts[i])
        matcher.rollback(len(drafts))
    verified = _verify(drafts, logits, params, generator)
    emitted = verified.token_ids
    if matcher is not None:
        for token_id in emitted:
            matcher.accept(token_id)
    logprobs: list[TokenLogprob | None] = [None] * len(emitted)
    if params.logprobs is not None:
        num_top = [params.logprobs] * len(emitted)
        logprobs = list(token_logprobs(logits[: len(emitted)], emitted, num_top))
    tokens = [
        SampledToken(token_id, logprob) for token_id, logprob in zip(emitted, logprobs, strict=True)
    ]
    return SampledToken(tokens[-1].token_id, tokens[-1].logprob, accepted_drafts=tuple(tokens[:-1]))


def _verify(
    drafts: list[int], logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> VerifiedTokens:
    if params.temperature == 0.0:
        return verify_greedy(drafts, logits)
    probs = sampling_probs(logits, [params] * logits.shape[0])
    return verify_sampled(drafts, probs, None, generator)
