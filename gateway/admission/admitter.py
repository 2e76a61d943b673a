"""Admission: gather the facts of one request, ask the policies in order, reserve its budget.

Order (the first refusal wins)::

    model access (404/403) -> routing of aliases -> rollout version -> priority
      -> prompt length (400)
      -> output cap (400) -> rate limits (429 + Retry-After) -> budget reservation (429)

The policies up to the output cap decide from the cached key's quota; rate limits and the
budget are counted in one step of the `AdmissionStore`, which also checks that the key's
tenant did not change since the key was cached (`key_cache`). If it did, the key is read again
and the request decided afresh; a refusal by the earlier policies checks the epoch too, so a
quota raised a moment ago is never refused on the old one.

An alias (``auto``) is routed to a public model first; a rollout then picks the version
(`gateway.rollouts`) whose model entry serves it: its tokenizer counts the prompt, its context
window bounds it. ``served_model`` stays the public name (what the client is answered with).

The result is an `Admission` (forward it; settle or release its reservation exactly once, see
`gateway.ledger.settlement`) or a `Refusal` that keeps whatever was decided before the refusal, for
the usage record.

Redis unreachable (every call bounded by ``redis_timeout_s``): with ``redis_failure_mode:
closed`` the counting step answers 503 ``service_unavailable``; with ``open`` the request is
admitted uncounted (no rate limit, no reservation; logged and counted in
``uncounted_admissions``) and its usage is recorded as usual. A counting step whose reply came
too late may have reserved on the server all the same: that reservation is released in the
background (``gateway.ledger.settle_retries``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import anyio
import jinja2
from redis.exceptions import RedisError

from gateway.admission.admission_store import (
    AdmissionAsk,
    AdmissionStore,
    AdmissionTimedOut,
    AuthChanged,
    BalanceUnknown,
    BudgetAsk,
    Counted,
)
from gateway.admission.token_counter import (
    INLINE_TOKENIZE_CHARS,
    ExactCounter,
    PromptTokens,
    TokenCounter,
)
from gateway.api.request_body import CompletionBody
from gateway.auth.bearer_keys import Caller, auth_unavailable
from gateway.auth.epochs import AuthEpochs
from gateway.auth.key_cache import CachedKey, KeyCache
from gateway.errors import ApiError, invalid_request, state_unavailable
from gateway.ledger.budget_ledger import Balance, BudgetLedger, Reservation
from gateway.ledger.settle_retries import LedgerRetries
from gateway.observability.metrics import GatewayMetrics
from gateway.rollouts import LiveRollouts, RolloutTable, resolve_version
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.usage_store import sum_tokens
from gateway.upstream.pool_load import PoolLoadView
from policies import (
    Rejection,
    RequestFeatures,
    RoutingDecision,
    admit_budget,
    budget_window,
    check_model_access,
    check_prompt_length,
    check_rate_limit,
    detect_code_or_math,
    reservation_tokens,
    resolve_max_tokens,
    resolve_priority,
    route,
)
from policies.budget_period import BudgetWindow
from policies.quota import PriorityClass, TenantQuota

logger = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_FAR_FUTURE = datetime(9999, 1, 1, tzinfo=timezone.utc)


_MAX_AUTH_RELOADS = 5  # a tenant changed this often during one request: answer 503
_REDIS_WARNING_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Admission:
    served_model: str  # the public name: a model, or a rollout
    version: str  # the model entry that serves it (``served_model`` unless a rollout's)
    route: RoutingDecision | None
    prompt_tokens: int
    max_tokens: int
    priority: PriorityClass
    reservation: Reservation | None
    headers: Mapping[str, str] = field(default_factory=dict)  # x-ratelimit-*
    # The prompt's ids as the version's engine makes them, where its replicas are chosen by
    # prefix (the replica router hashes them; tokenized once, here): else None.
    prompt_token_ids: Sequence[int] | None = None


@dataclass(frozen=True)
class Refusal:
    rejection: Rejection
    served_model: str | None = None
    route: RoutingDecision | None = None
    prompt_tokens: int = 0
    version: str | None = None


@dataclass(frozen=True)
class _Plan:
    """What the policies decided before anything is counted."""

    served_model: str
    version: str
    route: RoutingDecision | None
    prompt_tokens: int
    max_tokens: int
    priority: PriorityClass
    prompt_token_ids: Sequence[int] | None

    @property
    def tokens(self) -> int:
        return reservation_tokens(self.prompt_tokens, self.max_tokens)


class Admitter:
    def __init__(
        self,
        settings: GatewaySettings,
        counters: Mapping[str, TokenCounter],
        store: AdmissionStore,
        ledger: BudgetLedger,
        keys: KeyCache,
        epochs: AuthEpochs,
        pool_load: PoolLoadView,
        database: Database,
        clock: Callable[[], float] = time.time,
        metrics: GatewayMetrics | None = None,
        retries: LedgerRetries | None = None,
        rollouts: LiveRollouts | None = None,
    ) -> None:
        self._settings = settings
        self._rollouts = rollouts if rollouts is not None else LiveRollouts(settings.rollouts)
        self._counters = counters
        self._store = store
        self._ledger = ledger
        self._keys = keys
        self._epochs = epochs
        self._pool_load = pool_load
        self._database = database
        self._clock = clock
        self._metrics = metrics
        self._retries = retries
        self._redis_warned_at = float("-inf")  # one log line a second while Redis is down
        self._num_unlogged = 0

    async def admit(
        self, key: CachedKey, body: CompletionBody, priority_header: str | None
    ) -> Admission | Refusal:
        """Raises a 401 `ApiError` if the key stopped working since it was cached."""
        for _ in range(_MAX_AUTH_RELOADS):
            plan = await self._plan(key.caller, body, priority_header)
            if isinstance(plan, Refusal):
                epoch = await self._current_epoch(key.caller.tenant_id)
                if epoch is None or epoch == key.epoch:  # None: Redis down, fail-open
                    return plan
            else:
                decision = await self._count(key, plan)
                if not isinstance(decision, AuthChanged):
                    return decision
                epoch = decision.epoch
            key = await self._keys.reload(key, epoch)
        raise auth_unavailable()

    async def _plan(
        self, caller: Caller, body: CompletionBody, priority_header: str | None
    ) -> _Plan | Refusal:
        quota = caller.quota
        rejection = check_model_access(body.model, quota, self._settings.known_models)
        if rejection is not None:
            return Refusal(rejection)
        table: RolloutTable = self._rollouts.table  # one table for the whole request

        def version_of(model: str) -> str:
            return resolve_version(table, model, caller.tenant_id, body.user)

        served, decision = body.model, None
        version = version_of(served)
        routing = self._settings.routing
        pair = routing.aliases.get(body.model) if routing is not None else None
        candidates = [pair.small, pair.large] if pair is not None else [served]
        # No candidate admits a longer prompt: one longer by its length alone is not tokenized.
        limit = max(self._longest_prompt(version_of(m), quota) for m in candidates)
        counts: dict[str, PromptTokens] = {}  # by counter fingerprint: one per tokenizer
        prompt_tokens = (
            await self._count_tokens(version, body, counts, limit)
            if version in self._counters
            else 0
        )
        if routing is not None and pair is not None:
            small = version_of(pair.small)
            prompt_tokens = await self._count_tokens(small, body, counts, limit)
            has_code, has_math = detect_code_or_math(body.prompt_text)  # bounded, linear
            features = RequestFeatures(
                prompt_tokens=prompt_tokens,
                max_tokens=body.max_tokens or quota.default_max_output_tokens or 0,
                num_turns=body.num_turns,
                has_code=has_code,
                has_math=has_math,
                tenant_tier=quota.tier,
                hint=_hint(body.raw.get("tollway_hint")),
            )
            load = await self._pool_load.load(version_of(pair.large))
            decision = route(body.model, features, routing, load, quota.allow_fallback_to_small)
            served = decision.model
            version = version_of(served)
            if version != small:
                prompt_tokens = await self._count_tokens(version, body, counts, limit)

        def refuse(rejection: Rejection) -> Refusal:
            return Refusal(rejection, served, decision, prompt_tokens, version)

        priority = resolve_priority(priority_header, caller.key_priority, quota)
        if isinstance(priority, Rejection):
            return refuse(priority)
        context_window = self._settings.models[version].context_window
        rejection = check_prompt_length(
            prompt_tokens, quota, context_window, is_lower_bound=prompt_tokens > limit
        )
        if rejection is not None:
            return refuse(rejection)
        max_tokens = resolve_max_tokens(
            body.max_tokens, quota, prompt_tokens=prompt_tokens, context_window=context_window
        )
        if isinstance(max_tokens, Rejection):
            return refuse(max_tokens)
        ids = counts[self._counters[version].fingerprint].ids if version in self._counters else None
        return _Plan(served, version, decision, prompt_tokens, max_tokens, priority, ids)

    async def _count(self, key: CachedKey, plan: _Plan) -> Admission | Refusal | AuthChanged:
        """Rate limits and budget in one store step (rebuilding an unknown balance first)."""
        caller, quota, tokens = key.caller, key.caller.quota, plan.tokens
        budget = window = None
        if quota.budget_tokens is not None:
            window = budget_window(quota.budget_period, datetime.now(timezone.utc))
            budget = BudgetAsk(window.key, quota.budget_tokens, self._settings.reservation_ttl_s)
        now = self._clock()
        ask = AdmissionAsk(caller.tenant_id, key.epoch, tokens, quota.rpm, quota.tpm, now, budget)
        try:
            result = await self._store.admit(ask)
            if isinstance(result, BalanceUnknown) and window is not None:
                used = await anyio.to_thread.run_sync(self._used_in, caller.tenant_id, window)
                await self._ledger.rebuild(caller.tenant_id, window.key, used)
                result = await self._store.admit(ask)
        except RedisError as exc:
            return self._on_redis_failure(caller, plan, exc)
        if isinstance(result, AuthChanged):
            return result
        if not isinstance(result, Counted):  # unknown again: emptied twice in a row
            raise RuntimeError("the budget balance could not be rebuilt; please retry")

        def refuse(rejection: Rejection) -> Refusal:
            return Refusal(
                rejection, plan.served_model, plan.route, plan.prompt_tokens, plan.version
            )

        headers: Mapping[str, str] = {}
        if result.window is not None:
            allowance = check_rate_limit(
                result.window, rpm=quota.rpm, tpm=quota.tpm, request_tokens=tokens, now=now
            )
            if isinstance(allowance, Rejection):
                return refuse(allowance)
            headers = allowance.headers
        if result.balance is not None and window is not None and budget is not None:
            return refuse(_budget_refusal(result.balance, tokens, budget.limit, window))
        return Admission(
            plan.served_model,
            plan.version,
            plan.route,
            plan.prompt_tokens,
            plan.max_tokens,
            plan.priority,
            result.reservation,
            headers,
            plan.prompt_token_ids,
        )

    def _on_redis_failure(self, caller: Caller, plan: _Plan, exc: RedisError) -> Admission:
        """Redis failed: a 503 (``redis_failure_mode: closed``) or, fail-open, an admission
        that holds no reservation and passed no rate limit (its usage is still recorded)."""
        maybe_held = exc.reservation if isinstance(exc, AdmissionTimedOut) else None
        if maybe_held is not None and self._retries is not None:  # free what it may hold
            self._retries.later(maybe_held, 0)
        is_open = self._settings.redis_failure_mode == "open"
        now = time.monotonic()
        if now - self._redis_warned_at < _REDIS_WARNING_INTERVAL_S:
            self._num_unlogged += 1
        else:
            logger.warning(
                "Redis failed while admitting a request of tenant %s (%s); %s "
                "(%d more since the last line)",
                caller.tenant_id,
                exc,
                "admitted without rate limits or budget" if is_open else "answered 503",
                self._num_unlogged,
            )
            self._redis_warned_at, self._num_unlogged = now, 0
        if not is_open:
            raise state_unavailable("its rate-limit and budget store") from None
        if self._metrics is not None:
            self._metrics.uncounted_admissions.inc()
        return Admission(
            plan.served_model,
            plan.version,
            plan.route,
            plan.prompt_tokens,
            plan.max_tokens,
            plan.priority,
            None,
            prompt_token_ids=plan.prompt_token_ids,
        )

    async def _current_epoch(self, tenant_id: str) -> str | None:
        """The tenant's auth epoch; ``None`` if Redis failed and the failure mode is open."""
        try:
            return await self._epochs.current(tenant_id)
        except RedisError:
            if self._settings.redis_failure_mode != "open":
                raise
            return None

    def _longest_prompt(self, model: str, quota: TenantQuota) -> int:
        """The most prompt tokens ``check_prompt_length`` admits on ``model``."""
        longest = self._settings.models[model].context_window - 1
        if quota.max_prompt_tokens is not None:
            longest = min(longest, quota.max_prompt_tokens)
        return longest

    async def _count_tokens(
        self, model: str, body: CompletionBody, counts: dict[str, PromptTokens], limit: int
    ) -> int:
        """The prompt's tokens for ``model``, as its engine counts them, or a lower bound above
        ``limit`` (`count_prompt_tokens`); a tokenizer already run for this request
        (``counts``, by fingerprint) is not run again. For a model whose replicas are chosen
        by prefix, its exact counter also keeps the ids (`tokenize_prompt`)."""
        counter = self._counters[model]
        wants_ids = self._settings.models[model].replica_policy == "prefix" and isinstance(
            counter, ExactCounter
        )
        known = counts.get(counter.fingerprint)
        if known is None or (wants_ids and known.ids is None and known.count <= limit):
            counts[counter.fingerprint] = await self._tokenize(counter, body, limit, wants_ids)
        return counts[counter.fingerprint].count

    async def _tokenize(
        self, counter: TokenCounter, body: CompletionBody, limit: int, wants_ids: bool
    ) -> PromptTokens:
        run = tokenize_prompt if wants_ids else _count_only
        try:
            if body.prompt_chars < INLINE_TOKENIZE_CHARS:
                return run(counter, body, limit)
            return await anyio.to_thread.run_sync(run, counter, body, limit)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise _bad_messages(exc) from None

    def _used_in(self, tenant_id: str, window: BudgetWindow) -> int:
        """Tokens the usage records charge to the window (a rebuild after a ledger restart)."""
        with self._database.session() as session:
            totals = sum_tokens(
                session, tenant_id, window.start or _EPOCH, window.end or _FAR_FUTURE
            )
        return totals.prompt_tokens + totals.completion_tokens


def count_prompt_tokens(
    counter: TokenCounter, body: CompletionBody, limit: int | None = None
) -> int:
    """The prompt tokens the model's engine will report for ``body``: what is reserved.

    A prompt longer than ``limit`` tokens by its (rendered) length alone is not tokenized: the
    answer is then a lower bound above ``limit``. Chats raise ``ValueError``/``TypeError``/
    ``jinja2.TemplateError`` where the template would.
    """
    if body.messages is not None:
        return counter.count_chat(body.messages, limit)
    if isinstance(body.prompt, list):
        return len(body.prompt)  # token ids go to the model as they are
    return counter.count_prompt(body.prompt or "", limit)


def tokenize_prompt(counter: TokenCounter, body: CompletionBody, limit: int) -> PromptTokens:
    """`count_prompt_tokens` with the ids, from an exact counter (`ExactCounter`)."""
    if not isinstance(counter, ExactCounter):
        raise TypeError(f"{type(counter).__name__} counts tokens but has no engine ids")
    if body.messages is not None:
        return counter.tokenize_chat(body.messages, limit)
    if isinstance(body.prompt, list):
        return PromptTokens(len(body.prompt), body.prompt)
    return counter.tokenize_prompt(body.prompt or "", limit)


def _count_only(counter: TokenCounter, body: CompletionBody, limit: int) -> PromptTokens:
    return PromptTokens(count_prompt_tokens(counter, body, limit), None)


def _budget_refusal(balance: Balance, tokens: int, limit: int, window: BudgetWindow) -> Rejection:
    rejection = admit_budget(
        used=balance.used,
        reserved=balance.reserved,
        request_tokens=tokens,
        limit=limit,
        window=window,
    )
    # The store refused on the balance it saw, so the policy agrees; the fallback only keeps
    # the types honest.
    return rejection or Rejection(
        429, "insufficient_quota", "insufficient_quota", "You exceeded your token budget."
    )


def _hint(value: Any) -> Any:
    return value if value in ("small", "large") else None


def _bad_messages(exc: Exception) -> ApiError:
    return invalid_request(
        f"The messages cannot be rendered for this model: {exc}", param="messages"
    )
