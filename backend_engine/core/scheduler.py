"""Continuous batching: which requests run in the next step, and with how many tokens.

Every step, under a token budget (``max_num_batched_tokens``):
1. Running requests go first: decodes (one token each), then the next chunks of
   prefills in progress. When KV blocks run out, the least important running
   request (batch before interactive, latest arrival first) is preempted: its
   blocks are freed and it is recomputed later, ahead of later arrivals.
2. If nothing was preempted, waiting requests are admitted in ``WaitingQueue``
   order while sequences, budget and blocks last, keeping a watermark of free
   blocks so running requests can grow. A long prompt takes only what is left
   of the budget; its remainder is prefilled in later steps (chunked prefill),
   so it never stalls running decodes.

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

In ``static`` mode a new batch is admitted only once the previous one has
drained entirely: the classic padded-batch behaviour, kept for comparison.
The scheduler is plain Python over token ids and block ids; it never sees a tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from backend_engine.config import SchedulingMode
from backend_engine.core.kv_cache_manager import BlockCopy, CachedPrefix, KVCacheManager
from backend_engine.core.request import OutputMatcher, Request, RequestStatus
from backend_engine.core.stop_rules import token_stop
from backend_engine.core.waiting_queue import WaitingQueue
from backend_engine.outputs import FinishReason
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
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
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
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        candidates = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        unscheduled = list(candidates)
        for request in candidates:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = max(unscheduled, key=lambda r: (r.priority, r.arrival_seq))
                self._preempt(victim)
                unscheduled.remove(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            unscheduled.remove(request)
            scheduled.append((request, num_new))
            budget -= num_new

        if not preempted and (self.mode == "continuous" or not self.running):
            budget = self._admit(budget, scheduled)

        described = [self._describe(r, n) for r, n in scheduled]
        copies, self._block_copies = tuple(self._block_copies), []
        return SchedulerOutput(
            [item for item in described if item.is_decode],
            [item for item in described if not item.is_decode],
            [r.request_id for r in preempted],
            copies,
        )

    def _admit(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        """Move waiting requests into ``running`` and schedule their first prefill chunk.

        Continuous mode admits while the step has token budget left. Static mode forms a
        whole batch of ``max_num_seqs`` at once: requests beyond this step's budget join the
        batch with nothing scheduled and are prefilled, in chunks, over the next steps.
        """
        running_by_tenant = Counter(r.tenant_id for r in self.running)
        while (
            self.waiting
            and (budget > 0 or self.mode == "static")
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting.peek(running_by_tenant)
            if request is None:
                break
            prefix = self._cached_prefix(request)
            num_new = min(request.num_tokens - prefix.num_tokens, budget)
            reserved = self.num_watermark_blocks if self.running else 0
            if self.kv_cache.allocate_slots(request, num_new, prefix, reserved) is None:
                break
            self.waiting.remove(request)
            del self._prefixes[request.request_id]
            request.num_computed_tokens = prefix.num_tokens
            if request.num_cached_tokens is None:  # its first admission
                request.num_cached_tokens = prefix.num_tokens
                self.first_admissions.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            running_by_tenant[request.tenant_id] += 1
            if num_new > 0:
                scheduled.append((request, num_new))
                budget -= num_new
        return budget

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

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        do_sample = start + num_new == request.num_tokens
        forks: tuple[ForkedChoice, ...] = ()
        if do_sample and request.pending_forks:
            forks = tuple(
                ForkedChoice(c.request_id, c.sampling_params, c.matcher)
                for c in request.pending_forks
            )
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_table=self.kv_cache.block_table(request.request_id),
            sampling_params=request.sampling_params,
            do_sample=do_sample,
            is_decode=num_new == 1,
            matcher=request.matcher,
            forks=forks,
            all_token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            num_reported_prompt_logprobs=len(request.prompt_logprobs or ()),
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.add_preempted(request)
        self.num_preemptions += 1

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens and finish the requests that stop
        on their token (eos, a stop token, max_tokens, the model length: the rule is
        :func:`~backend_engine.core.stop_rules.token_stop`). Returns the requests that received
        a token this step (finished ones included), each leader followed by the choices it
        forked.

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
            request.num_computed_tokens += item.num_tokens
            token_id = sampled_token_ids.get(item.request_id)
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
        stop = token_stop(request, token_id, self.eos_token_ids, self.max_model_len)
        if stop is None:
            return False
        if stop.on_stop_token:
            request.stop_token_id = token_id
        self.finish(request.request_id, stop.reason)
        return True

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
