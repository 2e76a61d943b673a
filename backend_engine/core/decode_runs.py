"""Decode runs: a step of greedy decodes that the runner repeats back to back, each token fed
straight back, before the engine loop sees any of them.

Why: a decode step's own compute can be small next to the loop around it. On the 2-core
development machine SmolLM2-135M's native step (the layers and the output projection) takes
~4.9 ms, and the rest of a step ~1.2 ms (scheduling, the batch's tensors, sampling, the output
processor, the engine's bookkeeping): a fifth of single-stream time. A run of ``k`` steps pays
that once (vLLM's multi-step scheduling does the same on GPUs).

- **When** (:func:`schedule_run`): only a step that is nothing but one-token decodes, every
  one of them greedy with nothing between its logits and its token (no logprobs, logit bias,
  penalties or grammar; no drafts), and only while no request waits: a request that arrives
  during a run waits for it to end, which the engine bounds in time
  (:func:`decode_run_length`). ``k`` never passes a request's ``max_tokens`` nor the model
  length, so nothing is computed that the limits would drop.
- **Room:** each decode's ``k - 1`` later tokens take lookahead slots, like drafts: their blocks
  are offered to the prefix cache only once the tokens are the request's.
- **Taking** (the scheduler, as for drafts): the run's tokens are appended one at a time under
  the stop rule, so a request stops exactly where a step-by-step decode would have; tokens a
  run computed past a stop are dropped, and their blocks go back.

Greedy decoding is a function of the tokens alone, so a run gives the same tokens as the same
steps taken one at a time. Plain Python over requests and block ids, like the scheduler.
"""

from __future__ import annotations

import math

from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request
from backend_engine.core.step_plan import StepPlan


def can_join_run(request: Request) -> bool:
    """Whether a decoding request's next tokens are its model's argmax alone: greedy, with no
    logprobs, no logits processing, no grammar, no drafts and no choices waiting to fork."""
    params = request.sampling_params
    return (
        params.temperature == 0.0
        and params.logprobs is None
        and not params.processes_logits
        and request.matcher is None
        and not request.draft_token_ids
        and not request.pending_forks
    )


def schedule_run(
    step: StepPlan,
    kv_cache: KVCacheManager,
    num_watermark_blocks: int,
    max_model_len: int,
    max_steps: int,
) -> int:
    """Extend a step of one-token greedy decodes into a run: up to ``max_steps`` tokens per
    sequence, lookahead slots for all but the first. Returns the run's length (1: no run).

    The caller has already checked that nothing waits and that the step admitted and
    preempted nothing."""
    requests = list(step.scheduled)
    if max_steps < 2 or not requests or step.preempted or step.admitted:
        return 1
    if any(
        n != 1 or r.num_output_tokens == 0 or not can_join_run(r) for r, n in step.scheduled.items()
    ):
        return 1
    num_steps = min(
        max_steps,
        *(r.max_tokens - r.num_output_tokens for r in requests),
        *(max_model_len - r.num_tokens for r in requests),
    )
    if num_steps < 2:
        return 1
    # All or none: a run is one batch. Count the blocks first, so a refusal leaves no table grown.
    num_needed = sum(
        kv_cache.blocks_needed(r.num_computed_tokens + num_steps)
        - len(kv_cache.block_table(r.request_id))
        for r in requests
    )
    if num_needed + num_watermark_blocks > kv_cache.num_free_blocks:
        return 1
    for request in requests:
        allocation = kv_cache.allocate_slots(request, 1, num_lookahead_tokens=num_steps - 1)
        assert allocation is not None  # counted above
    return num_steps


def decode_run_length(
    seconds_per_step: float | None, max_run_seconds: float, max_steps: int
) -> int:
    """How many steps a run may take: as many as fit ``max_run_seconds`` at the last decode
    step's pace (what an arriving request may have to wait), at most ``max_steps``; 1 until a
    decode step has been timed."""
    if seconds_per_step is None or seconds_per_step <= 0.0:
        return 1
    return max(1, min(max_steps, math.floor(max_run_seconds / seconds_per_step)))
