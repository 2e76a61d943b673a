"""What admitting one request comes to: an `Admission` to forward, or a `Refusal` to record.

An `Admission` that holds a reservation is settled or released exactly once
(`gateway.accounting.settlement`). A `Refusal` keeps whatever was decided before the refusal
(the served model, its route and version, the prompt's tokens), for the usage record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.ledger.budget_ledger import Reservation
from policies import Rejection, RoutingDecision
from policies.quota import PriorityClass
from policies.scoped_budgets import ScopedBudget


@dataclass(frozen=True)
class Admission:
    served_model: str  # the public name: a model, or a rollout
    version: str  # the model entry that serves it (``served_model`` unless a rollout's)
    route: RoutingDecision | None
    prompt_tokens: int  # every prompt's
    max_tokens: int  # each choice's
    priority: PriorityClass
    reservation: Reservation | None
    headers: Mapping[str, str] = field(default_factory=dict)  # x-ratelimit-*
    # The prompt's ids as the version's engine makes them, where its replicas are chosen by
    # prefix (the replica router hashes them; tokenized once, in admission): else None.
    prompt_token_ids: Sequence[int] | None = None
    num_choices: int = 1  # n for each prompt
    # The budgets its reservation holds against (tenant, key, end user), with their limits.
    budgets: tuple[ScopedBudget, ...] = ()

    @property
    def max_completion_tokens(self) -> int:
        """The most completion tokens the engine may generate for it: every choice's."""
        return self.num_choices * self.max_tokens


@dataclass(frozen=True)
class Refusal:
    rejection: Rejection
    served_model: str | None = None
    route: RoutingDecision | None = None
    prompt_tokens: int = 0
    version: str | None = None
