"""A tenant's limits: one frozen `TenantQuota`, validated on construction and
stored as JSON through `to_dict` / `from_dict`.

Every limit is optional: ``None`` means unlimited (or "all models" for
``allowed_models``). Counts must be positive integers; use ``allowed_models=frozenset()``
to lock a tenant out entirely. ``alert_thresholds`` are the tenant's own budgets' alert
thresholds (percents of each limit, ascending); ``None`` uses the ``alerts:`` default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from policies.budget_alerts import check_budget_thresholds

BudgetPeriod = Literal["day", "month", "total"]
PriorityClass = Literal["interactive", "batch"]

BUDGET_PERIODS: tuple[BudgetPeriod, ...] = get_args(BudgetPeriod)
PRIORITY_CLASSES: tuple[PriorityClass, ...] = get_args(PriorityClass)

_OPTIONAL_COUNTS = (
    "budget_tokens",
    "budget_micros",
    "max_output_tokens",
    "default_max_output_tokens",
    "max_prompt_tokens",
    "rpm",
    "tpm",
)


@dataclass(frozen=True)
class TenantQuota:
    budget_tokens: int | None = None
    # A money budget (micro-units of the models' prices) over the same period; a request
    # must fit both when both are set (``policies.scoped_budgets``).
    budget_micros: int | None = None
    budget_period: BudgetPeriod = "month"
    max_output_tokens: int | None = None
    default_max_output_tokens: int | None = None
    clamp_max_output: bool = False
    max_prompt_tokens: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    allowed_models: frozenset[str] | None = None
    priority: PriorityClass = "interactive"
    tier: str = "standard"
    allow_fallback_to_small: bool = False
    alert_thresholds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in _OPTIONAL_COUNTS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be a positive integer or null, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value} (use null for no limit)")
        if self.budget_period not in BUDGET_PERIODS:
            raise ValueError(
                f"budget_period must be one of {', '.join(BUDGET_PERIODS)}, "
                f"got {self.budget_period!r}"
            )
        if self.priority not in PRIORITY_CLASSES:
            raise ValueError(
                f"priority must be one of {', '.join(PRIORITY_CLASSES)}, got {self.priority!r}"
            )
        for name in ("clamp_max_output", "allow_fallback_to_small"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.tier, str) or not self.tier.strip():
            raise ValueError(f"tier must be a non-empty string, got {self.tier!r}")
        if self.allowed_models is not None:
            if not isinstance(self.allowed_models, frozenset):
                raise ValueError(
                    "allowed_models must be a frozenset of model names or None, "
                    f"got {type(self.allowed_models).__name__}"
                )
            bad = [m for m in self.allowed_models if not isinstance(m, str) or not m.strip()]
            if bad:
                raise ValueError(f"allowed_models must hold non-empty names, got {bad!r}")
        if self.alert_thresholds is not None:
            thresholds = check_budget_thresholds(self.alert_thresholds)
            object.__setattr__(self, "alert_thresholds", thresholds)
        if (
            self.default_max_output_tokens is not None
            and self.max_output_tokens is not None
            and self.default_max_output_tokens > self.max_output_tokens
        ):
            raise ValueError(
                f"default_max_output_tokens ({self.default_max_output_tokens}) exceeds "
                f"max_output_tokens ({self.max_output_tokens}); lower the default or raise the cap"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``allowed_models`` becomes a sorted list (or null), the thresholds a
        list."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.allowed_models is not None:
            data["allowed_models"] = sorted(self.allowed_models)
        if self.alert_thresholds is not None:
            data["alert_thresholds"] = list(self.alert_thresholds)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TenantQuota:
        """Inverse of `to_dict`. Missing keys take their defaults; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown tenant quota field(s): {', '.join(unknown)}; "
                f"expected some of {', '.join(sorted(known))}"
            )
        kwargs = dict(data)
        models = kwargs.get("allowed_models")
        if models is not None:
            if isinstance(models, str) or not isinstance(models, list | tuple | set | frozenset):
                raise ValueError(
                    f"allowed_models must be a list of model names or null, got {models!r}"
                )
            kwargs["allowed_models"] = frozenset(models)
        return cls(**kwargs)
