"""Speculative decoding's part of a scheduler step: scheduling a decode's draft tokens after
its last token, and taking what the runner kept of them.

- **Scheduling** (:func:`schedule_drafts`): once every decode has its one token, each one's
  drafts (``Request.draft_token_ids``, set by the engine's speculator) are scheduled after it,
  as far as the budget and the blocks above the watermark allow (drafts are optional: they
  never preempt, nor take the room kept for admissions), and never past its ``max_tokens``
  (the last token a verification emits is the target's own, so at most ``max_tokens - 1``
  more drafts can pay) or the model length. Their blocks are lookahead: none is offered to
  the prefix cache while it holds an unverified token.
- **Taking** (:func:`take_verified`): the kept drafts, then the runner's own token, are
  appended one at a time under the stop rule, so a request stops exactly where it would have
  without speculation; only the last token and the kept drafts count as computed. The caller
  then offers the blocks they filled to the prefix cache (a decode's next step would, but a
  request that stops has none: without this its last step's blocks would be lost to the
  cache) and trims the blocks that only rejected drafts took.

Plain Python over requests and block ids, like the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request
from backend_engine.core.scheduler_output import ScheduledRequest
from backend_engine.core.step_plan import StepPlan
from backend_engine.core.stop_rules import TokenStop


def schedule_drafts(
    step: StepPlan,
    decodes: Sequence[Request],
    kv_cache: KVCacheManager,
    num_watermark_blocks: int,
    max_model_len: int,
) -> None:
    """Extend each decode scheduled in ``step`` (with one token) by the drafts that fit."""
    for request in decodes:
        drafts = request.draft_token_ids
        if not drafts or step.scheduled.get(request) != 1 or request.num_output_tokens == 0:
            continue  # nothing proposed, not scheduled (preempted, no budget), or a prefill
        num_output_left = request.max_tokens - request.num_output_tokens
        num_drafts = min(
            len(drafts), step.budget, num_output_left - 1, max_model_len - request.num_tokens
        )
        if num_drafts <= 0:
            continue
        allocation = kv_cache.allocate_slots(
            request, 1, num_reserved_blocks=num_watermark_blocks, num_lookahead_tokens=num_drafts
        )
        if allocation is not None:
            step.add(request, num_drafts)


def take_verified(
    item: ScheduledRequest,
    request: Request,
    token_id: int | None,
    accepted_draft_ids: Sequence[int],
    stop_of: Callable[[Request, int], TokenStop | None],
) -> tuple[bool, TokenStop | None]:
    """Advance a chunk with drafts (or a decode run, whose tokens before its last come as
    ``accepted_draft_ids``): its last token and the ``accepted_draft_ids`` are
    computed; they, then ``token_id``, are appended until one stops the request (``stop_of``
    is the stop rule; the caller finishes the request). Whether it received tokens (not when
    ``token_id`` is None: nothing was verified), and the stop, if one came."""
    accepted = tuple(accepted_draft_ids) if token_id is not None else ()
    request.num_computed_tokens += item.num_tokens - len(item.draft_token_ids) + len(accepted)
    if token_id is None:
        return False, None
    for new_token_id in (*accepted, token_id):
        request.all_token_ids.append(new_token_id)
        stop = stop_of(request, new_token_id)
        if stop is not None:
            return True, stop
    return True, None
