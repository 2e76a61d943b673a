"""Admission: gather the facts of one request, ask the policies in order, reserve its budget.

Order (the first refusal wins)::

    model access (404/403) -> routing of aliases -> priority -> prompt length (400)
      -> output cap (400) -> rate limits (429 + Retry-After) -> budget reservation (429)

The result is an `Admission` (forward it; settle or release its reservation exactly once, see
`gateway.accounting`) or a `Refusal` that keeps whatever was decided before the refusal, for
the usage record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import anyio
import jinja2

from gateway.api_errors import ApiError, invalid_request
from gateway.auth import Caller
from gateway.budget_ledger import BudgetLedger, Reservation
from gateway.pool_load import PoolLoadReader
from gateway.rate_limit_store import RateLimitStore
from gateway.request_body import CompletionBody
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.usage_store import sum_tokens
from gateway.token_counter import TokenCounter
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
from policies.quota import PriorityClass

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_FAR_FUTURE = datetime(9999, 1, 1, tzinfo=timezone.utc)


_INLINE_COUNT_CHARS = 16_384  # longer chats are counted on a worker thread


@dataclass(frozen=True)
class Admission:
    served_model: str
    route: RoutingDecision | None
    prompt_tokens: int
    max_tokens: int
    priority: PriorityClass
    reservation: Reservation | None
    headers: Mapping[str, str] = field(default_factory=dict)  # x-ratelimit-*


@dataclass(frozen=True)
class Refusal:
    rejection: Rejection
    served_model: str | None = None
    route: RoutingDecision | None = None
    prompt_tokens: int = 0


class Admitter:
    def __init__(
        self,
        settings: GatewaySettings,
        counters: Mapping[str, TokenCounter],
        ledger: BudgetLedger,
        rate_limits: RateLimitStore,
        pool_load: PoolLoadReader,
        database: Database,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._counters = counters
        self._ledger = ledger
        self._rate_limits = rate_limits
        self._pool_load = pool_load
        self._database = database
        self._clock = clock

    async def admit(
        self, caller: Caller, body: CompletionBody, priority_header: str | None
    ) -> Admission | Refusal:
        quota = caller.quota
        rejection = check_model_access(body.model, quota, self._settings.known_models)
        if rejection is not None:
            return Refusal(rejection)
        served, decision = body.model, None
        prompt_tokens = await self._count(served, body) if served in self._counters else 0
        routing = self._settings.routing
        if routing is not None and body.model in routing.aliases:
            pair = routing.aliases[body.model]
            prompt_tokens = await self._count(pair.small, body)
            has_code, has_math = detect_code_or_math(body.prompt_text)
            features = RequestFeatures(
                prompt_tokens=prompt_tokens,
                max_tokens=body.max_tokens or quota.default_max_output_tokens or 0,
                num_turns=body.num_turns,
                has_code=has_code,
                has_math=has_math,
                tenant_tier=quota.tier,
                hint=_hint(body.raw.get("tollway_hint")),
            )
            load = await self._pool_load.load(pair.large)
            decision = route(body.model, features, routing, load, quota.allow_fallback_to_small)
            served = decision.model
            if served != pair.small:
                prompt_tokens = await self._count(served, body)

        def refuse(rejection: Rejection) -> Refusal:
            return Refusal(rejection, served, decision, prompt_tokens)

        priority = resolve_priority(priority_header, caller.key_priority, quota)
        if isinstance(priority, Rejection):
            return refuse(priority)
        context_window = self._settings.models[served].context_window
        rejection = check_prompt_length(prompt_tokens, quota, context_window)
        if rejection is not None:
            return refuse(rejection)
        max_tokens = resolve_max_tokens(
            body.max_tokens, quota, prompt_tokens=prompt_tokens, context_window=context_window
        )
        if isinstance(max_tokens, Rejection):
            return refuse(max_tokens)
        tokens = reservation_tokens(prompt_tokens, max_tokens)
        headers: Mapping[str, str] = {}
        if quota.rpm is not None or quota.tpm is not None:
            now = self._clock()
            report = await self._rate_limits.hit(
                caller.tenant_id, tokens, quota.rpm, quota.tpm, now
            )
            allowance = check_rate_limit(
                report, rpm=quota.rpm, tpm=quota.tpm, request_tokens=tokens, now=now
            )
            if isinstance(allowance, Rejection):
                return refuse(allowance)
            headers = allowance.headers
        reservation = None
        if quota.budget_tokens is not None:
            window = budget_window(quota.budget_period, datetime.now(timezone.utc))
            result = await self._reserve(caller.tenant_id, window, quota.budget_tokens, tokens)
            if isinstance(result, Rejection):
                return refuse(result)
            reservation = result
        return Admission(
            served, decision, prompt_tokens, max_tokens, priority, reservation, headers
        )

    async def _count(self, model: str, body: CompletionBody) -> int:
        counter = self._counters[model]
        if body.messages is not None:
            messages = body.messages
            # Counting a typical chat takes microseconds: a thread hand-off would cost more
            # than the work, so only long conversations leave the event loop.
            size = sum(len(str(m.get("content") or "")) for m in messages)
            try:
                if size < _INLINE_COUNT_CHARS:
                    return counter.count_chat(messages)
                return await anyio.to_thread.run_sync(counter.count_chat, messages)
            except (ValueError, TypeError, jinja2.TemplateError) as exc:
                raise _bad_messages(exc) from None
        if isinstance(body.prompt, list):
            return len(body.prompt)
        return counter.count_text(body.prompt or "")

    async def _reserve(
        self, tenant_id: str, window: BudgetWindow, limit: int, tokens: int
    ) -> Reservation | Rejection:
        if not await self._ledger.is_known(tenant_id, window.key):
            used = await anyio.to_thread.run_sync(self._used_in, tenant_id, window)
            await self._ledger.rebuild(tenant_id, window.key, used)
        reservation = await self._ledger.reserve(
            tenant_id, window.key, limit, tokens, self._settings.reservation_ttl_s
        )
        if reservation is not None:
            return reservation
        balance = await self._ledger.balance(tenant_id, window.key)
        rejection = admit_budget(
            used=balance.used,
            reserved=balance.reserved,
            request_tokens=tokens,
            limit=limit,
            window=window,
        )
        if rejection is not None:
            return rejection
        # The balance moved between reserve() and balance(): the refusal stands.
        return admit_budget(
            used=limit, reserved=0, request_tokens=tokens, limit=limit
        ) or Rejection(
            429, "insufficient_quota", "insufficient_quota", "You exceeded your token budget."
        )

    def _used_in(self, tenant_id: str, window: BudgetWindow) -> int:
        """Tokens the usage records charge to the window (a rebuild after a ledger restart)."""
        with self._database.session() as session:
            totals = sum_tokens(
                session, tenant_id, window.start or _EPOCH, window.end or _FAR_FUTURE
            )
        return totals.prompt_tokens + totals.completion_tokens


def _hint(value: Any) -> Any:
    return value if value in ("small", "large") else None


def _bad_messages(exc: Exception) -> ApiError:
    return invalid_request(
        f"The messages cannot be rendered for this model: {exc}", param="messages"
    )
