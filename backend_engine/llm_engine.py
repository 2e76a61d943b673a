"""The synchronous engine: one ``step()`` is schedule → execute → update.

One request's failure fails only that request. The runner pins failures in the forward
pass and sampling on the requests that cause them; the per-request work of ``update``
(detokenizing, stop strings) fails alone too. A failed request finishes with
``finish_reason="error"`` and an ``error`` message, its KV blocks and generator released;
the others go on with the tokens they would have had without it.

A request with ``n`` > 1 becomes a group of choices (`make_request`): choice 0 keeps the
caller's id, choice ``i`` is ``f"{request_id}#{i}"`` with the seed ``choice_seed(seed, i)``;
the scheduler prefills the prompt once and forks the others off it. Every delta carries the
caller's id and its choice's ``index``.

Not thread-safe: ``AsyncEngine`` drives it from one background thread.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
from bisect import bisect_left
from dataclasses import replace
from typing import TYPE_CHECKING

from backend_engine.config import EngineConfig
from backend_engine.core.decode_runs import decode_run_length
from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.kv_event_log import KVCacheEvent
from backend_engine.core.request import Request
from backend_engine.core.scheduler import Scheduler, SchedulerOutput
from backend_engine.core.step_runner import (
    DraftRowCost,
    DraftRowCostProbe,
    PlanRunner,
    RunnerPlan,
)
from backend_engine.outputs import (
    QUEUE_TIME_BUCKETS,
    EngineStats,
    FinishReason,
    QueueTimes,
    RequestOutputDelta,
    TokenLogprob,
)
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams, choice_seed
from backend_engine.speculative.speculator import make_speculator
from backend_engine.text.output_processor import OutputProcessor
from model_files.checkpoint import Checkpoint
from model_files.model_config import ModelConfig

if TYPE_CHECKING:
    from backend_engine.structured_output.grammar_compiler import CompiledGrammar, GrammarCompiler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        plan_runner: PlanRunner | None = None,
        kv_events: list[KVCacheEvent] | None = None,
    ) -> None:
        """``plan_runner``: what computes the tokens (`backend_engine.core.step_runner`); by
        default the checkpoint's model, on ``config.device``, with torch. ``kv_events``: where
        the prefix cache appends its events (`backend_engine.core.kv_event_log`); None: nowhere."""
        self.config = config
        checkpoint = Checkpoint(config.model)
        self.model_config = checkpoint.check()  # refuses a bad file before anything is built
        self.tokenizer = checkpoint.tokenizer()
        self.max_model_len = self.model_config.check_max_model_len(config.max_model_len)
        plan = (plan_runner or _plan_model_runner)(config, self.model_config)
        block_bytes = plan.kv_bytes_per_block
        num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is too small for one "
                f"KV block of this model ({block_bytes} bytes)"
            )
        self.kv_cache = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            extra_key=_model_identity(checkpoint, plan.kv_dtype),
            kv_events=kv_events,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget,
            max_model_len=self.max_model_len,
            watermark=config.watermark,
            mode=config.scheduling,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_running_share=config.max_running_share,
        )
        self.runner = plan.build(num_blocks, checkpoint)
        self.outputs = OutputProcessor(self.tokenizer)
        self.speculator = make_speculator(  # None: no speculative decoding
            config, self.model_config.vocab_size, num_blocks, self._draft_row_cost()
        )
        if self.speculator is not None:
            logger.info(
                "speculative decoding: a draft costs %.2f of a one-token step",
                self.speculator.settings.draft_cost,
            )
        self._arrivals = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests = 0  # queued since start (`add`)
        # Per priority class: requests by queue-time bucket (`QUEUE_TIME_BUCKETS`), seconds.
        self._queue_times: dict[str, tuple[list[int], float]] = {}

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The structured outputs' compiler (llguidance is imported with the first one)."""
        from backend_engine.structured_output.grammar_compiler import (
            GrammarCompiler,
            GrammarCompilerSettings,
        )

        settings = GrammarCompilerSettings(
            cache_size=self.config.grammar_cache_size,
            compile_timeout_s=self.config.grammar_compile_timeout_s,
        )
        return GrammarCompiler(self.tokenizer, self.model_config.vocab_size, settings)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        tenant_id: str = "default",
        priority: Priority = Priority.INTERACTIVE,
    ) -> Request:
        """Validate and queue a request. Raises ValueError with a user-facing message."""
        request = self.make_request(request_id, prompt, sampling_params, tenant_id, priority)
        self.add(request)
        return request

    def add(self, request: Request) -> None:
        """Queue a request made by :meth:`make_request` (with its other choices, if any); if
        this raises, nothing is queued."""
        self.scheduler.add_request(request)
        group = [request, *request.pending_forks]
        try:
            for member in group:
                self.outputs.add(member)
        except Exception:
            for member in group:
                self.scheduler.finish(member.request_id, "error")
            raise
        self.num_requests += 1

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        tenant_id: str = "default",
        priority: Priority = Priority.INTERACTIVE,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        """Tokenize and validate without touching engine state (safe from any thread).

        ``grammar``: the structured output's, already compiled (`AsyncEngine` compiles it off
        its event loop first); otherwise it is compiled here, or found in the cache.

        With ``n`` > 1 the request returned is choice 0, holding the others (`choice_ids`
        names them) in ``pending_forks``, each with its own seed and matcher. Each choice alone
        must fit the KV cache; the group need not fit at once (the choices that find no room
        when they would be forked wait and run when blocks free up)."""
        prompt_token_ids = self.tokenize(prompt)
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        outside = sorted(t for t in sampling_params.logit_bias if t >= vocab_size)
        if outside:
            raise ValueError(
                f"logit_bias token ids must be in [0, {vocab_size}) (this model's vocabulary), "
                f"got {', '.join(map(str, outside[:5]))}{' ...' if len(outside) > 5 else ''}"
            )
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {num_prompt} tokens (at least one is needed for the output)."
            )
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
        elif num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                f"prompt, {max_tokens} for the completion)."
            )
        needed = self.kv_cache.blocks_needed(num_prompt + max_tokens)
        if needed > self.kv_cache.num_blocks:
            raise ValueError(
                f"the request needs up to {needed} KV blocks but the cache has only "
                f"{self.kv_cache.num_blocks}; lower max_tokens or the prompt length"
            )
        constraint = sampling_params.structured_output
        if constraint is not None and grammar is None:
            grammar = self.grammars.compile(constraint)
        arrival_seq = next(self._arrivals)
        arrived = time.monotonic()
        choices = []
        for index, choice_id in enumerate(choice_ids(request_id, sampling_params.n)):
            params = sampling_params
            if index > 0:
                seed = sampling_params.seed
                params = replace(
                    params, n=1, seed=choice_seed(seed, index) if seed is not None else None
                )
            choices.append(
                Request(
                    choice_id,
                    prompt_token_ids,
                    params,
                    max_tokens=max_tokens,
                    arrival_seq=arrival_seq,  # they arrived together
                    tenant_id=tenant_id,
                    priority=priority,
                    matcher=grammar.new_matcher() if constraint is not None and grammar else None,
                    group_id=request_id,
                    choice_index=index,
                    arrival_time=arrived,
                )
            )
        leader = choices[0]
        leader.pending_forks = choices[1:]
        return leader

    def abort(
        self, request_ids: list[str], reason: FinishReason = "abort"
    ) -> list[RequestOutputDelta]:
        """End these requests (``reason``: "error" for requests whose step failed, so blocks
        they never wrote leave the prefix cache)."""
        deltas = []
        for request in self.scheduler.finish_many(request_ids, reason):
            self._release(request.request_id)
            try:
                deltas.append(self.outputs.finish_without_token(request))
            except Exception as exc:  # flushing its text failed: it ends all the same
                deltas.append(self._failed(request, exc))
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutputDelta]:
        deltas = self._propose_drafts()
        output = self.scheduler.schedule()
        self._record_queue_times()
        if output.is_empty:
            return deltas
        started = time.perf_counter()
        result = self.runner.execute(output)
        self._pace_decode_runs(output, time.perf_counter() - started)
        self._record_prompt_logprobs(result.prompt_logprobs)
        for request_id, exc in result.failed.items():  # before update: no token, no progress
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request_id, "error")
                deltas.append(self._failed(request, exc))
        sampled = result.sampled
        accepted = {
            rid: [draft.token_id for draft in s.accepted_drafts]
            for rid, s in sampled.items()
            if s.accepted_drafts
        }
        updated = self.scheduler.update_from_output(
            output, {rid: s.token_id for rid, s in sampled.items()}, accepted
        )
        if self.speculator is not None:
            self.speculator.record(
                output.scheduled, {rid: len(s.accepted_drafts) for rid, s in sampled.items()}
            )
        computed_ids = {item.request_id for item in output.scheduled}
        for request in updated:
            if request.num_output_tokens == 1 and request.request_id in computed_ids:
                self.num_prompt_tokens += request.num_prompt_tokens  # just prefilled, not forked
            token = sampled[request.request_id]
            logprobs = [draft.logprob for draft in token.accepted_drafts] + [token.logprob]
            try:
                delta, hit_stop = self.outputs.process(request, logprobs)
            except Exception as exc:
                self.scheduler.finish(request.request_id, "error")
                deltas.append(self._failed(request, exc))
                continue
            self.num_generation_tokens += len(delta.new_token_ids)
            if hit_stop:
                self.scheduler.finish(request.request_id, "stop")
            if delta.finished:
                self._release(request.request_id)
            deltas.append(delta)
        return deltas

    def _pace_decode_runs(self, output: SchedulerOutput, seconds: float) -> None:
        """After a decode-only step, let the next runs take as many steps as fit
        ``decode_run_max_ms`` at its pace (:mod:`backend_engine.core.decode_runs`); never with
        speculative decoding, whose steps carry drafts instead."""
        config = self.config
        if output.prefills or not output.decodes:
            return
        if config.decode_run_steps < 2 or self.speculator is not None:
            return
        self.scheduler.max_decode_steps = decode_run_length(
            seconds / output.decodes[0].num_steps,
            config.decode_run_max_ms / 1e3,
            config.decode_run_steps,
        )

    def _propose_drafts(self) -> list[RequestOutputDelta]:
        """Speculative decoding: this step's drafts for the decoding sequences; a request
        whose proposer raised fails alone (its closing deltas are returned)."""
        if self.speculator is None:
            return []
        failures = self.speculator.propose(self.scheduler.running)
        deltas = []
        for request_id, exc in failures.items():
            request = self.scheduler.finish(request_id, "error")
            if request is not None:
                deltas.append(self._failed(request, exc))
        return deltas

    def _draft_row_cost(self) -> DraftRowCost | None:
        """Speculative decoding's cost of a draft to the target, measured by the runner now,
        before any request; None where it is configured or the runner cannot say."""
        config = self.config
        if config.speculative_proposer is None or config.speculative_draft_cost is not None:
            return None
        if not isinstance(self.runner, DraftRowCostProbe):
            return None
        cost = self.runner.measure_draft_row_cost(config.num_speculative_tokens)
        logger.info(
            "speculative decoding: a draft row costs %.2f of a one-token step (%.1f ms)",
            cost.row_cost,
            cost.step_seconds * 1e3,
        )
        return cost

    def _release(self, request_id: str) -> None:
        """Forget what the runner and the speculator keep for an ended request."""
        self.runner.release(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _record_prompt_logprobs(self, computed: dict[str, list[TokenLogprob | None]]) -> None:
        """Append each chunk's prompt logprobs to its request's (the first delta carries them)."""
        for request_id, entries in computed.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(entries)

    def _failed(self, request: Request, exc: Exception) -> RequestOutputDelta:
        """Close a request whose own work raised (already finished in the scheduler)."""
        logger.error(
            "request %s failed in the engine; the others go on", request.request_id, exc_info=exc
        )
        request.finish_reason = "error"
        self._release(request.request_id)
        return self.outputs.fail(request, f"{type(exc).__name__}: {exc}")

    def _record_queue_times(self) -> None:
        """Each request admitted for the first time this step: how long it waited, by class."""
        admitted, self.scheduler.first_admissions = self.scheduler.first_admissions, []
        now = time.monotonic()
        for request in admitted:
            if request.arrival_time is None:
                continue
            waited = max(now - request.arrival_time, 0.0)
            name = request.priority.name.lower()
            counts, total = self._queue_times.get(name, ([0] * (len(QUEUE_TIME_BUCKETS) + 1), 0.0))
            counts[bisect_left(QUEUE_TIME_BUCKETS, waited)] += 1
            self._queue_times[name] = (counts, total + waited)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_kv_blocks_total=self.kv_cache.num_blocks,
            num_kv_blocks_used=self.kv_cache.num_used_blocks,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_requests=self.num_requests,
            queue_times={
                name: QueueTimes(tuple(counts), total)
                for name, (counts, total) in self._queue_times.items()
            },
            speculative=(
                {self.speculator.proposer.name: self.speculator.counts}
                if self.speculator is not None
                else {}
            ),
        )


def choice_ids(request_id: str, n: int) -> list[str]:
    """The engine's ids of a request's ``n`` choices: the caller's own for choice 0."""
    return [request_id, *(f"{request_id}#{index}" for index in range(1, n))]


def _plan_model_runner(config: EngineConfig, model_config: ModelConfig) -> RunnerPlan:
    # Imported here: torch comes in with the model, not with the engine's loop.
    from backend_engine.worker.model_runner import plan_model_runner

    return plan_model_runner(config, model_config)


def _model_identity(checkpoint: Checkpoint, kv_dtype: str) -> bytes:
    """Prefix-cache key: blocks from another checkpoint or dtype must never match."""
    key = f"{checkpoint.fingerprint()}|{kv_dtype}"
    return hashlib.blake2b(key.encode(), digest_size=16).digest()
