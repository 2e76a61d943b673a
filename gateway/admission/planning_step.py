"""Admission's first step: what a request would run as, decided by the pure policies.

Order (the first refusal wins)::

    model access (404/403) -> routing of aliases -> rollout version -> priority
      -> prompt length (400) -> output cap (400)

An alias (``auto``) is routed to a public model first; a rollout then picks the version
(`gateway.rollouts`) whose model entry serves it: its tokenizer counts the prompt, its context
window bounds it. ``served_model`` stays the public name (what the client is answered with).
The policies decide from the caller's cached quota; the only work beyond them is counting the
prompts (`PromptCounts`) and, for an alias, reading the large pool's load. Nothing is counted
against the tenant here: that is the `gateway.admission.counting_step`'s.

A completion may carry several prompts, each answered with ``n`` choices: each prompt must
fit (the longest is checked against the context window and the tenant's
``max_prompt_tokens``, and leaves the room ``max_tokens`` is cut to), and the plan's
`AdmissionPlan.tokens` reserves every prompt once plus ``max_tokens`` for every choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.admission.outcomes import Admission, Refusal
from gateway.admission.prompt_tokens import PromptCounts, PromptSizes
from gateway.admission.token_counter import TokenCounter
from gateway.auth.bearer_keys import Caller
from gateway.completion_body import CompletionBody
from gateway.ledger.budget_ledger import Reservation
from gateway.rollouts import LiveRollouts, RolloutTable, resolve_version
from gateway.settings import GatewaySettings
from policies import (
    Rejection,
    RequestFeatures,
    RoutingDecision,
    check_model_access,
    check_prompt_length,
    detect_code_or_math,
    fit_context,
    reservation_tokens,
    resolve_max_tokens,
    resolve_priority,
    route,
)
from policies.model_routing import PoolLoad
from policies.quota import PriorityClass, TenantQuota
from policies.scoped_budgets import ScopedBudget


class PoolLoadSource(Protocol):
    """A model pool's load now, for routing an alias (``None``: unknown); the app's is
    `gateway.upstream.pool_load.PoolLoadView`."""

    async def load(self, model: str) -> PoolLoad | None: ...


@dataclass(frozen=True)
class AdmissionPlan:
    """What the policies decided before anything is counted."""

    served_model: str
    version: str
    route: RoutingDecision | None
    prompt_tokens: int  # every prompt's
    max_tokens: int  # each choice's
    priority: PriorityClass
    prompt_token_ids: Sequence[int] | None = field(default=None, repr=False)
    num_choices: int = 1  # n for each prompt
    end_user: str | None = None  # the request's ``user``: its end user's budget applies

    @property
    def tokens(self) -> int:
        """What the budget reserves for it (and what rate limits count): the prompts and the
        most every choice may generate."""
        return reservation_tokens(self.prompt_tokens, self.max_tokens, self.num_choices)

    def admit(
        self,
        reservation: Reservation | None,
        headers: Mapping[str, str] | None = None,
        budgets: tuple[ScopedBudget, ...] = (),
    ) -> Admission:
        return Admission(
            self.served_model,
            self.version,
            self.route,
            self.prompt_tokens,
            self.max_tokens,
            self.priority,
            reservation,
            headers or {},
            self.prompt_token_ids,
            self.num_choices,
            budgets,
        )

    def refuse(self, rejection: Rejection) -> Refusal:
        return Refusal(rejection, self.served_model, self.route, self.prompt_tokens, self.version)


class PlanningStep:
    def __init__(
        self,
        settings: GatewaySettings,
        counters: Mapping[str, TokenCounter],
        rollouts: LiveRollouts,
        pool_load: PoolLoadSource,
    ) -> None:
        self._settings = settings
        self._counters = counters
        self._rollouts = rollouts
        self._pool_load = pool_load

    async def plan(
        self, caller: Caller, body: CompletionBody, priority_header: str | None
    ) -> AdmissionPlan | Refusal:
        """Raises a 400 `ApiError` for messages a model's chat template cannot render."""
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
        counts = PromptCounts(self._counters, self._settings.models, body, limit)
        uncounted = PromptSizes(0, 0)
        prompts = await counts.count(version) if version in self._counters else uncounted
        if routing is not None and pair is not None:
            small = version_of(pair.small)
            prompts = await counts.count(small)
            has_code, has_math = detect_code_or_math(body.prompt_text)  # bounded, linear
            features = RequestFeatures(
                prompt_tokens=prompts.total,
                max_tokens=body.max_tokens or quota.default_max_output_tokens or 0,
                num_turns=body.num_turns,
                has_code=has_code,
                has_math=has_math,
                tenant_tier=quota.tier,
                hint=body.routing_hint,
            )
            load = await self._pool_load.load(version_of(pair.large))
            decision = route(body.model, features, routing, load, quota.allow_fallback_to_small)
            chosen = version_of(decision.model)
            chosen_prompts = await counts.count(chosen) if chosen != small else prompts
            if not self._fits(chosen, chosen_prompts, quota, limit):
                other = pair.small if decision.model == pair.large else pair.large
                other_prompts = await counts.count(version_of(other))
                other_fits = self._fits(version_of(other), other_prompts, quota, limit)
                decision = fit_context(decision, pair, chosen_fits=False, other_fits=other_fits)
            served = decision.model
            version = version_of(served)
            if version != small:
                prompts = await counts.count(version)
        prompt_tokens = prompts.total

        def refuse(rejection: Rejection) -> Refusal:
            return Refusal(rejection, served, decision, prompt_tokens, version)

        priority = resolve_priority(priority_header, caller.key_priority, quota)
        if isinstance(priority, Rejection):
            return refuse(priority)
        context_window = self._settings.models[version].context_window
        rejection = check_prompt_length(
            prompts.longest, quota, context_window, is_lower_bound=prompts.longest > limit
        )
        if rejection is not None:
            return refuse(rejection)
        max_tokens = resolve_max_tokens(
            body.max_tokens, quota, prompt_tokens=prompts.longest, context_window=context_window
        )
        if isinstance(max_tokens, Rejection):
            return refuse(max_tokens)
        ids = counts.ids(version) if version in self._counters else None
        return AdmissionPlan(
            served,
            version,
            decision,
            prompt_tokens,
            max_tokens,
            priority,
            ids,
            body.num_choices,
            body.user,
        )

    def _fits(self, model: str, prompts: PromptSizes, quota: TenantQuota, limit: int) -> bool:
        """Whether ``model``'s context window (and the tenant's prompt cap) holds the prompts."""
        window = self._settings.models[model].context_window
        longest = prompts.longest
        return check_prompt_length(longest, quota, window, is_lower_bound=longest > limit) is None

    def _longest_prompt(self, model: str, quota: TenantQuota) -> int:
        """The most prompt tokens ``check_prompt_length`` admits on ``model``."""
        longest = self._settings.models[model].context_window - 1
        if quota.max_prompt_tokens is not None:
            longest = min(longest, quota.max_prompt_tokens)
        return longest
