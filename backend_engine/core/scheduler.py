"""Continuous batching: which requests run in the next step, and with how many tokens.

Every step, under a token budget (``max_num_batched_tokens``):
1. Running decodes go first (one token each). When KV blocks run out, the least
   important running request (batch before interactive, latest arrival first) is
   preempted: its blocks are freed and it is recomputed later, ahead of later arrivals.
2. The rest is prefill budget, shared fairly among tenants (:mod:`.prefill_budget`); a
   tenant's first chunk while another has prompts in progress gets a short step of its own.
   Each prompt in progress gets its next chunk from its tenant's share. If nothing was
   preempted, waiting requests are then admitted in ``WaitingQueue`` order, each chunk
   within its tenant's share, keeping free a watermark of blocks (so running requests can
   grow) and the blocks that tenant's own chunks will take; then the chunks take theirs,
   preempting as above if they must. The first admission refused for blocks ends
   admission for the step, so a large prompt is not overtaken for ever.
3. What a tenant could not use goes to the others: prompts in progress, then admission.
A long prompt thus takes only its share, and its remainder is prefilled in later steps
(chunked prefill): it never stalls running decodes, nor another tenant's first token.
While another tenant waits, a tenant running ``max_running_share`` of ``max_num_seqs``
is admitted no more (nothing is preempted; the cap lifts when nobody else waits).

A waiting request's prefix-cache lookup is made once and kept until it is admitted
(redone only if a block it found was handed out meanwhile). After each step the
scheduler decides which requests stop on their new token (:mod:`.stop_rules`); stop
strings, which need text, are found by the output processor.

A request with ``n`` > 1 choices is prefilled once. Its leader (choice 0) is scheduled like
any request; the other choices wait as its ``pending_forks``, in ``requests`` (so finishing
or aborting finds them) but not in the waiting queue. The step that ends the leader's prefill
samples every pending choice's first token from the same logits row (``ScheduledRequest.forks``),
and ``update_from_output`` forks each one: references on the leader's full blocks, a copy of
its partial last block (``SchedulerOutput.block_copies``, made by the runner before the next
forward pass), and it runs on from there. A choice with no block for its copy (or no room
under ``max_num_seqs``) waits instead, like a preempted request, its first token kept, and is
recomputed (the prefix cache then has the full blocks). A leader that ends before its prefill
does (an abort, a failure) lets its pending choices go as ordinary waiting requests.

Speculative decoding: a decode's draft tokens (``Request.draft_token_ids``) are scheduled
after its last token where the step has room, and the tokens kept are taken back under the
stop rule (:mod:`.draft_steps`); continuous mode only.

Decode runs: a step of nothing but greedy one-token decodes, while nobody waits, is repeated
up to ``max_decode_steps`` times by the runner, each token fed back (:mod:`.decode_runs`); its
tokens are taken back like drafts. Continuous mode only.

In ``static`` mode a new batch is admitted only once the previous one has
drained entirely: the classic padded-batch behaviour, kept for comparison.
The scheduler is plain Python over token ids and block ids; it never sees a tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from backend_engine.config import DEFAULT_MAX_RUNNING_SHARE, SchedulingMode
from backend_engine.core.decode_runs import schedule_run
from backend_engine.core.draft_steps import schedule_drafts, take_verified
from backend_engine.core.kv_cache_manager import BlockCopy, CachedPrefix, KVCacheManager
from backend_engine.core.prefill_budget import (
    first_token_tenants,
    prefill_contenders,
    running_cap,
    share_prefill_budget,
)
from backend_engine.core.request import Request, RequestStatus
from backend_engine.core.scheduler_output import ScheduledRequest, SchedulerOutput, describe
from backend_engine.core.step_plan import StepPlan, is_prefill
from backend_engine.core.stop_rules import TokenStop, token_stop
from backend_engine.core.waiting_queue import WaitingQueue
from backend_engine.outputs import FinishReason

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]  # the output's types, re-exported


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        watermark: float = 0.01,
        mode: SchedulingMode = "continuous",
        eos_token_ids: frozenset[int] = frozenset(),
        max_running_share: float = DEFAULT_MAX_RUNNING_SHARE,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_running_per_tenant = running_cap(max_num_seqs, max_running_share)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.mode = mode
        self.eos_token_ids = eos_token_ids
        self.num_watermark_blocks = int(watermark * kv_cache.num_blocks)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Prefix-cache lookups of waiting requests that did not fit yet: one lookup per
        # admission, so the prefix-cache metrics count each admission once.
        self._prefixes: dict[str, CachedPrefix] = {}
        self._block_copies: list[BlockCopy] = []  # recorded by forks, for the next step
        self.num_preemptions = 0
        # Prompt tokens whose KV a step computed (prefix-cache hits and forks computed none).
        self.num_computed_prompt_tokens = 0
        # Requests admitted for the first time since the engine last took this list (for
        # their queue times: the scheduler itself reads no clock).
        self.first_admissions: list[Request] = []
        self._was_first_token_step = False  # two never follow each other (prefill_budget)
        # The longest decode run the next step may be (1: none); the engine sets it from its
        # clock (decode_runs.decode_run_length), as the scheduler reads none.
        self.max_decode_steps = 1

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a request, and hold its ``pending_forks`` (its other choices) until its
        prefill ends."""
        group = [request, *request.pending_forks]
        for member in group:
            if member.request_id in self.requests:
                raise ValueError(f"request id {member.request_id!r} is already in use")
        if len({member.request_id for member in group}) != len(group):
            raise ValueError(f"request {request.request_id!r} repeats a choice's id")
        for member in group:
            self.requests[member.request_id] = member
        for child in request.pending_forks:
            child.status = RequestStatus.AWAITING_FORK
            child.fork_parent = request
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        running = sorted(self.running, key=is_prefill)  # decodes first, else in order
        step = StepPlan(self.max_num_batched_tokens, list(running))
        num_steps = 1
        prefills = [r for r in running if is_prefill(r)]
        if self.mode == "continuous":
            decodes = [r for r in running if not is_prefill(r)]
            self._schedule_chunks(step, ((r, step.num_left(r)) for r in decodes))
            schedule_drafts(
                step, decodes, self.kv_cache, self.num_watermark_blocks, self.max_model_len
            )
            self._share_prefill_budget(step, prefills)
            if not self.waiting:
                num_steps = schedule_run(
                    step,
                    self.kv_cache,
                    self.num_watermark_blocks,
                    self.max_model_len,
                    self.max_decode_steps,
                )
        else:
            self._schedule_chunks(step, ((r, step.num_left(r)) for r in running))
            if not step.preempted and not self.running:
                self._admit(step)
        place = {request: index for index, request in enumerate(self.running)}
        described = [
            describe(r, n, self.kv_cache.block_table(r.request_id), num_steps)
            for r, n in sorted(step.scheduled.items(), key=lambda item: place[item[0]])
        ]
        for request in step.scheduled:
            request.draft_token_ids = ()  # proposed for this step only
        copies, self._block_copies = tuple(self._block_copies), []
        return SchedulerOutput(
            [item for item in described if item.is_decode],
            [item for item in described if not item.is_decode],
            [r.request_id for r in step.preempted],
            copies,
        )

    def _schedule_chunks(
        self, step: StepPlan, chunks: Iterable[tuple[Request, int]], may_shrink: bool = False
    ) -> None:
        """Schedule running requests' next tokens, in order, within the budget, preempting
        for blocks (``may_shrink``: a chunk first shrinks to the blocks left above the
        watermark); a request already scheduled this step is only extended, where blocks
        allow."""
        kv = self.kv_cache
        for request, num_wanted in chunks:
            num_new = min(num_wanted, step.budget)
            if num_new <= 0 or request.status is not RequestStatus.RUNNING:
                continue  # nothing left, or preempted earlier in this step
            done = step.scheduled.get(request, 0)
            if done:
                if kv.allocate_slots(request, done + num_new) is not None:
                    step.add(request, num_new)
                continue
            while kv.allocate_slots(request, num_new) is None:
                num_free = kv.num_free_blocks - self.num_watermark_blocks
                num_blocks = len(kv.block_table(request.request_id)) + num_free
                num_fit = num_blocks * kv.block_size - request.num_computed_tokens
                if may_shrink and 0 < num_fit < num_new:
                    num_new = num_fit
                    continue
                victim = max(step.unscheduled, key=lambda r: (r.priority, r.arrival_seq))
                self._preempt(victim)
                step.unscheduled.remove(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                step.unscheduled.remove(request)
                step.add(request, num_new)

    def _share_prefill_budget(self, step: StepPlan, prefills: list[Request]) -> None:
        """Continuous mode's prefill phase (steps 2 and 3 of the module docstring).

        Admissions take their blocks before the prompts in progress do, less what each
        tenant's own prompts in progress will take: another tenant's first chunk comes
        before them for blocks as for tokens, and a chunk it leaves short of blocks shrinks
        to those left above the watermark rather than preempt; but a tenant never admits a
        request at the cost of its own prompts in progress. A first-token step schedules the
        newcomers' shares alone: what they leave goes to nobody, so the step stays short.
        """
        running_by_tenant = Counter(r.tenant_id for r in self.running)
        contenders = prefill_contenders(
            prefills,
            self.waiting,
            running_by_tenant,
            step.budget,
            self.max_num_seqs - len(self.running),
            self.max_running_per_tenant,
            lambda r: r.num_tokens - self._cached_prefix(r).num_tokens,
        )
        shares = share_prefill_budget(step.budget, {c.tenant_id: c.num_tokens for c in contenders})
        newcomers = (
            frozenset() if self._was_first_token_step else first_token_tenants(contenders, prefills)
        )
        self._was_first_token_step = bool(newcomers)
        if newcomers:  # a first-token step: the newcomers' shares and the decodes only
            shares = {t: n if t in newcomers else 0 for t, n in shares.items()}
        chunks: list[tuple[Request, int]] = []
        held: Counter[str] = Counter()  # blocks each tenant's chunks will take
        for request in prefills:
            num_new = min(step.num_left(request), shares[request.tenant_id])
            if num_new > 0:
                chunks.append((request, num_new))
                shares[request.tenant_id] -= num_new
                num_total = request.num_computed_tokens + num_new
                num_held = self.kv_cache.blocks_needed(num_total)
                num_held -= len(self.kv_cache.block_table(request.request_id))
                held[request.tenant_id] += max(num_held, 0)
        if not step.preempted:
            self._admit(step, shares, held)
        self._schedule_chunks(step, chunks, may_shrink=bool(step.admitted))
        if newcomers:
            return
        # What a tenant could not use: prompts in progress, then admission, as they come.
        self._schedule_chunks(step, ((r, step.num_left(r)) for r in prefills + step.admitted))
        if not step.preempted:
            self._admit(step)

    def _admit(
        self, step: StepPlan, shares: dict[str, int] | None = None, held: Counter[str] | None = None
    ) -> None:
        """Move waiting requests into ``running`` in ``WaitingQueue`` order and schedule
        their first prefill chunks: with ``shares``, only of tenants with some share left,
        each chunk within it, leaving free the blocks ``held`` for the tenant's own chunks.

        Continuous mode admits while tokens are left. Static mode forms a whole batch of
        ``max_num_seqs`` at once: requests beyond this step's budget join the batch with
        nothing scheduled and are prefilled, in chunks, over the next steps.
        """
        running_by_tenant = Counter(r.tenant_id for r in self.running)
        while (
            self.waiting
            and (step.budget > 0 or self.mode == "static")
            and len(self.running) < self.max_num_seqs
            and not step.is_admission_closed
        ):
            tenants = None if shares is None else {t for t, n in shares.items() if n > 0}
            request = self.waiting.peek(
                running_by_tenant, tenants=tenants, max_running=self.max_running_per_tenant
            )
            if request is None:
                break
            prefix = self._cached_prefix(request)
            limit = step.budget if shares is None else min(shares[request.tenant_id], step.budget)
            num_new = min(request.num_tokens - prefix.num_tokens, limit)
            reserved = self.num_watermark_blocks if self.running else 0
            reserved += held[request.tenant_id] if held is not None else 0
            if self.kv_cache.allocate_slots(request, num_new, prefix, reserved) is None:
                step.is_admission_closed = True
                break
            self.waiting.remove(request)
            del self._prefixes[request.request_id]
            request.num_computed_tokens = prefix.num_tokens
            if request.num_cached_tokens is None:  # its first admission
                request.num_cached_tokens = prefix.num_tokens
                self.first_admissions.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.admitted.append(request)
            running_by_tenant[request.tenant_id] += 1
            if num_new > 0:
                step.add(request, num_new)
            if shares is not None:
                shares[request.tenant_id] -= num_new

    def _cached_prefix(self, request: Request) -> CachedPrefix:
        """The request's prefix-cache lookup, made once while it waits.

        A waiting request holds no references on the blocks it found: one with no other
        user sits in the free list and may be handed out (its hash evicted) before the
        request fits. Such a stale lookup is redone, never used.
        """
        prefix = self._prefixes.get(request.request_id)
        if prefix is None or not self.kv_cache.is_still_cached(prefix):
            prefix = self.kv_cache.get_computed_blocks(request)
            self._prefixes[request.request_id] = prefix
        return prefix

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.add_preempted(request)
        self.num_preemptions += 1

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int],
        accepted_draft_ids: Mapping[str, Sequence[int]] | None = None,
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens and finish the requests that stop
        on their token (eos, a stop token, max_tokens, the model length: the rule is
        :func:`~backend_engine.core.stop_rules.token_stop`). Returns the requests that received
        a token this step (finished ones included), each leader followed by the choices it
        forked.

        ``accepted_draft_ids``: for a chunk with drafts, the leading drafts the runner kept;
        for a decode run, the run's tokens before its last. They come before its sampled
        token, each under the stop rule in turn.

        A leader's pending choices are forked before its own stop rule runs, so one that stops
        on its first token (``max_tokens=1``, eos) still leaves them its prompt's KV: its
        freed partial block is copied before any forward pass can write it again."""
        updated: list[Request] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                # It failed after its choices were sampled: they keep their tokens.
                self._take_orphaned_first_tokens(item, sampled_token_ids, updated)
                continue
            prompt_end = min(item.start_position + item.num_tokens, request.num_prompt_tokens)
            self.num_computed_prompt_tokens += max(prompt_end - item.start_position, 0)
            token_id = sampled_token_ids.get(item.request_id)
            if item.draft_token_ids or item.num_steps > 1:
                accepted = (accepted_draft_ids or {}).get(item.request_id, ())
                received, stop = take_verified(item, request, token_id, accepted, self._stop_of)
                if received:
                    updated.append(request)
                # Blocks full of tokens whose KV is computed, all but the last (as a decode's
                # next step would offer them): a request that stops here has no next step.
                # Blocks that only rejected drafts, or a run's tokens past a stop, took go back.
                num_cached = min(request.num_computed_tokens, request.num_tokens - 1)
                self.kv_cache.cache_blocks(request, num_cached)
                if stop is not None:
                    self._finish_on(request, stop)
                else:
                    self.kv_cache.trim(request, request.num_computed_tokens)
                continue
            request.num_computed_tokens += item.num_tokens
            if not item.do_sample or token_id is None:
                continue
            request.all_token_ids.append(token_id)
            updated.append(request)
            if request.pending_forks:
                self._fork_pending(request, sampled_token_ids, updated)
            self._stop_on_token(request, token_id)
        return updated

    def _stop_on_token(self, request: Request, token_id: int) -> bool:
        """Finish ``request`` if it stops on its new token; whether it did."""
        stop = self._stop_of(request, token_id)
        if stop is None:
            return False
        self._finish_on(request, stop)
        return True

    def _stop_of(self, request: Request, token_id: int) -> TokenStop | None:
        return token_stop(request, token_id, self.eos_token_ids, self.max_model_len)

    def _finish_on(self, request: Request, stop: TokenStop) -> None:
        """Finish ``request`` on its last token, which stopped it."""
        if stop.on_stop_token:
            request.stop_token_id = request.all_token_ids[-1]
        self.finish(request.request_id, stop.reason)

    def _fork_pending(
        self, leader: Request, sampled_token_ids: Mapping[str, int], updated: list[Request]
    ) -> None:
        """Each pending choice of a leader whose prompt is now computed takes its first
        token and runs on the leader's KV (or waits, when there is no room for it)."""
        children, leader.pending_forks = leader.pending_forks, []
        for child in children:
            child.fork_parent = None
            token_id = sampled_token_ids.get(child.request_id)
            if token_id is None:  # not sampled (a runner that left it out): it prefills itself
                self._release(child)
                continue
            child.all_token_ids.append(token_id)
            child.num_cached_tokens = leader.num_cached_tokens
            child.prompt_logprobs = leader.prompt_logprobs  # computed once, the same for all
            updated.append(child)
            if self._stop_on_token(child, token_id):
                continue  # done before it needed any KV
            copies = None
            if len(self.running) < self.max_num_seqs:
                reserved = self.num_watermark_blocks
                copies = self.kv_cache.fork(leader, child, num_reserved_blocks=reserved)
            if copies is None:
                self._release(child)
                continue
            self._block_copies.extend(copies)
            child.num_computed_tokens = leader.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)

    def _take_orphaned_first_tokens(
        self, item: ScheduledRequest, sampled_token_ids: Mapping[str, int], updated: list[Request]
    ) -> None:
        """Choices sampled with a leader that then failed were let go as waiting requests (see
        `finish`); their first token (which their matcher and generator have consumed) is
        theirs all the same, and they recompute from there."""
        for fork in item.forks:
            child = self.requests.get(fork.request_id)
            token_id = sampled_token_ids.get(fork.request_id)
            if child is None or token_id is None or child.num_output_tokens > 0:
                continue
            if child.status is not RequestStatus.WAITING:
                continue
            child.all_token_ids.append(token_id)
            updated.append(child)
            self._stop_on_token(child, token_id)

    def _release(self, child: Request) -> None:
        """A choice that will not be forked becomes an ordinary waiting request, ahead of
        later arrivals (it arrived with its leader)."""
        child.fork_parent = None
        child.status = RequestStatus.WAITING
        self.waiting.add_preempted(child)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish (or abort) a request wherever it is and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.AWAITING_FORK:
            if request.fork_parent is not None:
                request.fork_parent.pending_forks.remove(request)
                request.fork_parent = None
        else:
            self.waiting.remove(request)
            self._prefixes.pop(request_id, None)
        children, request.pending_forks = request.pending_forks, []
        for child in children:  # it ends before its prefill: they prefill themselves
            self._release(child)
        if reason == "error":  # its step may have failed before writing its KV
            self.kv_cache.free(request, num_written_tokens=request.num_computed_tokens)
        else:
            self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    def finish_many(self, request_ids: Iterable[str], reason: FinishReason) -> list[Request]:
        finished = [self.finish(rid, reason) for rid in request_ids]
        return [r for r in finished if r is not None]
