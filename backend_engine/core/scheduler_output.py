"""What one scheduler step decides: the requests it computes, each with its tokens, block
table and sampling settings, as the runner reads them (ids and token ids only)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backend_engine.core.kv_cache_manager import BlockCopy
from backend_engine.core.request import OutputMatcher, Request
from backend_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ForkedChoice:
    """A choice that takes its first token from its leader's logits row: the runner samples
    it with the choice's own settings, generator (by ``request_id``) and matcher."""

    request_id: str
    sampling_params: SamplingParams
    matcher: OutputMatcher | None = None


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # position of token_ids[0]
    block_table: list[int]
    sampling_params: SamplingParams
    do_sample: bool  # this chunk ends at the last known token: sample the next one
    # One token against the KV already cached: computed as a decode (one query row per
    # sequence). Otherwise a prefill chunk (several query rows, causal within the chunk).
    is_decode: bool
    matcher: OutputMatcher | None = None  # the next token's mask, for a structured output
    # With do_sample, the choices to fork off this request: each is sampled from its row too.
    forks: tuple[ForkedChoice, ...] = ()
    # The request's tokens so far (its own list, not a copy: read it before the step's update
    # appends to it), of which the first ``num_prompt_tokens`` are the prompt: the penalties'
    # history, and the prompt tokens whose logprobs this chunk computes.
    all_token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    # With ``prompt_logprobs``: how many of the prompt's entries were already reported
    # (a recompute after preemption owes none of those again).
    num_reported_prompt_logprobs: int = 0
    # Speculative decoding: the last ``len(draft_token_ids)`` of ``token_ids`` are proposed
    # tokens after the request's last one. The runner scores all of them in this chunk (a row
    # of logits per token) and verifies the drafts (``backend_engine.speculative.verification``).
    draft_token_ids: tuple[int, ...] = ()
    # A decode run (``backend_engine.core.decode_runs``): the runner decodes this many tokens
    # one after another, each fed back, into the lookahead slots after ``token_ids[0]``
    # (``block_table`` has them); every item of the step has the same count. 1: one token.
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: list[ScheduledRequest]  # each computes one token
    prefills: list[ScheduledRequest]  # chunks of prompts (or of a recompute)
    preempted_request_ids: list[str]
    # KV blocks to copy before this step's forward pass (the partial blocks of forked choices).
    block_copies: tuple[BlockCopy, ...] = ()

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Everything this step computes, decodes first: the flat batch layout."""
        return self.decodes + self.prefills

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.block_copies


def describe(
    request: Request, num_new: int, block_table: list[int], num_steps: int = 1
) -> ScheduledRequest:
    """The next ``num_new`` tokens of ``request`` as the runner reads them: its own, then, past
    its last token, its drafts (speculative decoding); ``num_steps``: a decode run's length."""
    start = request.num_computed_tokens
    num_drafts = max(start + num_new - request.num_tokens, 0)
    drafts = request.draft_token_ids[:num_drafts]
    do_sample = start + num_new - num_drafts == request.num_tokens
    forks: tuple[ForkedChoice, ...] = ()
    if do_sample and request.pending_forks:
        forks = tuple(
            ForkedChoice(c.request_id, c.sampling_params, c.matcher) for c in request.pending_forks
        )
    return ScheduledRequest(
        request_id=request.request_id,
        token_ids=request.all_token_ids[start : start + num_new - num_drafts] + list(drafts),
        start_position=start,
        block_table=block_table,
        sampling_params=request.sampling_params,
        do_sample=do_sample,
        is_decode=num_new == 1,
        matcher=request.matcher,
        forks=forks,
        all_token_ids=request.all_token_ids,
        num_prompt_tokens=request.num_prompt_tokens,
        num_reported_prompt_logprobs=len(request.prompt_logprobs or ()),
        draft_token_ids=drafts,
        num_steps=num_steps,
    )
