"""Pure policy functions: (request, tenant state, now) -> decision. No I/O."""

from policies.budget_admission import admit_budget, reservation_tokens
from policies.budget_period import BudgetWindow, budget_window, period_key
from policies.decision import Rejection
from policies.model_access import check_model_access
from policies.model_routing import (
    ModelPair,
    ModelSize,
    PoolLoad,
    RequestFeatures,
    RoutingDecision,
    RoutingPolicy,
    detect_code_or_math,
    fit_context,
    route,
)
from policies.output_cap import resolve_max_tokens
from policies.priority import resolve_priority
from policies.prompt_length import check_prompt_length
from policies.quota import BudgetPeriod, PriorityClass, TenantQuota
from policies.rate_limit import (
    RateLimitAllowance,
    WindowReport,
    check_rate_limit,
    format_duration,
)

__all__ = [
    "BudgetPeriod",
    "BudgetWindow",
    "ModelPair",
    "ModelSize",
    "PoolLoad",
    "PriorityClass",
    "RateLimitAllowance",
    "Rejection",
    "RequestFeatures",
    "RoutingDecision",
    "RoutingPolicy",
    "TenantQuota",
    "WindowReport",
    "admit_budget",
    "budget_window",
    "check_model_access",
    "check_prompt_length",
    "check_rate_limit",
    "detect_code_or_math",
    "fit_context",
    "format_duration",
    "period_key",
    "reservation_tokens",
    "resolve_max_tokens",
    "resolve_priority",
    "route",
]
