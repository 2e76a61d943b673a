"""The console's forms read and checked, each error tied to its field so the page shows it
beside the field: a tenant to create, the quota editor, a key's or an end user's budget, a
key to create.

The rules are the admin API's own: a tenant's id and names go through its pydantic schemas
(`TenantCreate`, `ApiKeyCreate`), a quota through `TenantQuota`, a budget through
`ScopedBudget`. Money is typed in currency units (``12.50``) and kept in micros; alert
thresholds as percents separated by commas (``50, 80, 100``; blank: the default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.api.admin_schemas import MAX_COUNT, ApiKeyCreate, TenantCreate
from policies.budget_alerts import MAX_THRESHOLD_PERCENT, check_budget_thresholds
from policies.quota import BUDGET_PERIODS, BudgetPeriod, TenantQuota
from policies.scoped_budgets import MICROS_PER_UNIT, ScopedBudget

QUOTA_COUNT_FIELDS = ("budget_tokens", "rpm", "tpm", "max_output_tokens", "max_prompt_tokens")
MONEY_FIELD = "budget_money"
THRESHOLDS_FIELD = "alert_thresholds"
MAX_SUBJECT_LENGTH = 256


@dataclass(frozen=True)
class FormResult:
    """What a form said: ``values`` as typed (to show again), ``errors`` by field."""

    values: Mapping[str, str]
    errors: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_valid(self) -> bool:
        return not self.errors


def tenant_to_create(form: Mapping[str, str]) -> tuple[TenantCreate | None, FormResult]:
    values = {"id": form.get("id", "").strip(), "name": form.get("name", "")}
    return _model(TenantCreate, values)


def key_to_create(form: Mapping[str, str]) -> tuple[ApiKeyCreate | None, FormResult]:
    return _model(ApiKeyCreate, {"name": form.get("name", "")})


def quota_from_form(
    form: Mapping[str, str], stored: TenantQuota
) -> tuple[TenantQuota | None, FormResult]:
    """The stored quota with the editor's fields replaced; blank means no limit."""
    names = (*QUOTA_COUNT_FIELDS, MONEY_FIELD, "budget_period", THRESHOLDS_FIELD)
    values = {name: form.get(name, "").strip() for name in names}
    errors: dict[str, str] = {}
    changes: dict[str, Any] = {}
    for name in QUOTA_COUNT_FIELDS:
        changes[name], error = _count(values[name])
        if error:
            errors[name] = error
    changes["budget_micros"], error = _money(values[MONEY_FIELD])
    if error:
        errors[MONEY_FIELD] = error
    if values["budget_period"] not in BUDGET_PERIODS:
        errors["budget_period"] = f"Choose one of {', '.join(BUDGET_PERIODS)}."
    else:
        changes["budget_period"] = values["budget_period"]
    changes[THRESHOLDS_FIELD], error = _thresholds(values[THRESHOLDS_FIELD])
    if error:
        errors[THRESHOLDS_FIELD] = error
    if errors:
        return None, FormResult(values, errors)
    try:
        quota = TenantQuota.from_dict({**stored.to_dict(), **changes})
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        shown = MONEY_FIELD if name == "budget_micros" else name
        return None, FormResult(values, {shown if shown in values else "quota": f"{exc}."})
    return quota, FormResult(values)


def budget_from_form(
    form: Mapping[str, str], key_ids: frozenset[str]
) -> tuple[ScopedBudget | None, FormResult]:
    """A key's budget (``scope=key``, ``subject`` one of ``key_ids``) or an end user's."""
    names = ("scope", "key_id", "end_user", "unit", "amount", "period", THRESHOLDS_FIELD)
    values = {name: form.get(name, "").strip() for name in names}
    errors: dict[str, str] = {}
    scope = values["scope"]
    subject = ""
    if scope == "key":
        subject = values["key_id"]
        if subject not in key_ids:
            errors["key_id"] = "Choose one of this tenant's keys."
    elif scope == "user":
        subject = values["end_user"]
        if not subject or len(subject) > MAX_SUBJECT_LENGTH or "\x00" in subject:
            errors["end_user"] = (
                f"The end user's id, as requests send it in `user` (1 to {MAX_SUBJECT_LENGTH} "
                "characters)."
            )
    else:
        errors["scope"] = "Choose an API key or an end user."
    unit = values["unit"]
    amount: int | None = None
    if unit == "tokens":
        amount, error = _count(values["amount"], required=True)
    elif unit == "money":
        amount, error = _money(values["amount"], required=True)
    else:
        error = None
        errors["unit"] = "Choose tokens or money."
    if error:
        errors["amount"] = error
    if values["period"] not in BUDGET_PERIODS:
        errors["period"] = f"Choose one of {', '.join(BUDGET_PERIODS)}."
    thresholds, error = _thresholds(values[THRESHOLDS_FIELD])
    if error:
        errors[THRESHOLDS_FIELD] = error
    if errors or amount is None:
        return None, FormResult(values, errors)
    budget = ScopedBudget(
        scope="key" if scope == "key" else "user",
        unit="micros" if unit == "money" else "tokens",
        limit=amount,
        period=_period(values["period"]),
        subject=subject,
        alert_thresholds=thresholds,
    )
    return budget, FormResult(values)


def _period(value: str) -> BudgetPeriod:
    return "day" if value == "day" else "total" if value == "total" else "month"


def _model(model: type[BaseModel], values: dict[str, str]) -> tuple[Any, FormResult]:
    try:
        return model.model_validate(values), FormResult(values)
    except ValidationError as exc:
        errors: dict[str, str] = {}
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"]) or "form"
            errors.setdefault(name, _message(error))
        return None, FormResult(values, errors)


def _message(error: Any) -> str:
    if error["type"] == "string_pattern_mismatch":
        if error["loc"] == ("id",):
            return "1 to 64 of A-Z, a-z, 0-9, '.', '_', '-', starting with a letter or digit."
        return "No NUL, bidirectional or zero-width characters."
    return str(error["msg"]) + "."


def _count(text: str, *, required: bool = False) -> tuple[int | None, str | None]:
    if not text:
        return None, ("Required." if required else None)
    hint = "a whole number of at least 1" + ("" if required else ", or blank for no limit")
    if not text.isdigit():
        return None, f"Enter {hint}."
    value = int(text)
    if not 1 <= value <= MAX_COUNT:
        return None, f"Enter {hint} (at most {MAX_COUNT})."
    return value, None


def _thresholds(text: str) -> tuple[tuple[int, ...] | None, str | None]:
    """Percents separated by commas or spaces, as `check_budget_thresholds` takes them."""
    if not text:
        return None, None
    hint = (
        f"Enter whole percents in 1..{MAX_THRESHOLD_PERCENT}, ascending and unique, such as "
        "50, 80, 100 (or blank for the default)."
    )
    parts = text.replace(",", " ").split()
    if not all(part.isdigit() for part in parts):
        return None, hint
    try:
        return check_budget_thresholds([int(part) for part in parts]), None
    except ValueError:
        return None, hint


def _money(text: str, *, required: bool = False) -> tuple[int | None, str | None]:
    """Currency units with at most six decimals, as micros."""
    if not text:
        return None, ("Required." if required else None)
    hint = "an amount such as 12.50 (at most 6 decimals)" + (
        "" if required else ", or blank for no limit"
    )
    try:
        amount = Decimal(text)
    except InvalidOperation:
        return None, f"Enter {hint}."
    micros = amount * MICROS_PER_UNIT
    if not amount.is_finite() or micros != micros.to_integral_value() or micros < 1:
        return None, f"Enter {hint}."
    if micros > MAX_COUNT:
        return None, f"At most {MAX_COUNT // MICROS_PER_UNIT:,} units."
    return int(micros), None
