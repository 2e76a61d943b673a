"""Request and response bodies of the admin API (pydantic), shared with its OpenAPI document.

The schemas say exactly what the server accepts, so the OpenAPI document is a contract a
generator can test against: text fields refuse NUL (PostgreSQL's ``text`` cannot store it),
names that must not be blank say so with a pattern, and ``expires_at`` is an RFC 3339
date-time with a time zone that stays within year 9999 in UTC. The one rule a schema
cannot state, that ``expires_at`` lies in the future, is in its description.

Tenant and key names are shown to people: they refuse bidirectional controls and
zero-width characters (which make a name display as another, or two names look alike),
and are stored NFC-normalized, so a composed and a decomposed spelling are the same name.
Lists are pages: ``next_cursor`` goes back as ``cursor`` for the next one.
"""

from __future__ import annotations

import re
import unicodedata
from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from policies.budget_alerts import MAX_THRESHOLD_PERCENT, check_budget_thresholds
from policies.quota import BudgetPeriod, PriorityClass, TenantQuota

TENANT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
TEXT_PATTERN = r"^[^\x00]*$"  # any text but NUL
NON_BLANK_PATTERN = r"^[^\x00]*[^\x00\s][^\x00]*$"  # and at least one character that is not a space
# Bidirectional controls (U+202A-202E, U+2066-2069, U+200E/200F) and zero-width characters
# (U+200B-200D, U+2060, U+FEFF); the characters themselves, so every regex engine reads them.
INVISIBLE_CHARACTERS = "\u200b-\u200f\u202a-\u202e\u2060\u2066-\u2069\ufeff"
NAME_PATTERN = f"^[^\\x00{INVISIBLE_CHARACTERS}]*$"
MAX_NAME_LENGTH = 200
DEFAULT_PAGE_SIZE = 100  # as the usage export's
MAX_PAGE_SIZE = 1000
DEFAULTS = TenantQuota()
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", re.ASCII
)


def _rfc3339_text(value: object) -> object:
    if isinstance(value, datetime):  # built in Python, not parsed from JSON
        return value
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        raise ValueError(
            "expected an RFC 3339 date-time with a time zone, e.g. 2030-01-01T00:00:00Z"
        )
    return value


def _in_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("expected a date-time with a time zone, e.g. 2030-01-01T00:00:00Z")
    try:
        return value.astimezone(timezone.utc)
    except OverflowError:  # 9999-12-31T23:00:00-05:00 is in year 10000 in UTC
        raise ValueError("expected a date-time from year 1 to 9999 in UTC") from None


UtcDateTime = Annotated[datetime, BeforeValidator(_rfc3339_text), AfterValidator(_in_utc)]
MAX_COUNT = 2**53 - 1  # exact as a JSON number everywhere, Redis' Lua included


def _integral(value: object) -> object:
    """JSON Schema's ``integer`` takes 5.0 as 5: so do we (but not 5.5, "5" or true)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _nfc(value: str) -> str:
    normalized = unicodedata.normalize("NFC", value)
    if len(normalized) > MAX_NAME_LENGTH:  # composition can, rarely, lengthen a string
        raise ValueError(f"at most {MAX_NAME_LENGTH} characters once NFC-normalized")
    return normalized


Name = Annotated[str, Field(max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN), AfterValidator(_nfc)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT), BeforeValidator(_integral)]
ModelName = Annotated[str, Field(min_length=1, pattern=NON_BLANK_PATTERN)]


def _ascending_unique(percents: object) -> object:
    """Checked whole, before the items, so a 400 names the field (not one item of it); 50.0
    is 50, as for every integer here. Ascending is the one rule the schema cannot state."""
    if isinstance(percents, list):
        percents = [_integral(percent) for percent in percents]
    return list(check_budget_thresholds(percents))


AlertThresholds = Annotated[
    list[Annotated[int, Field(ge=1, le=MAX_THRESHOLD_PERCENT)]],
    Field(
        min_length=1,
        description="A budget's own alert thresholds, percents of its limit, ascending and "
        "unique (e.g. [50, 80, 100]); null: the alerts settings' default.",
        json_schema_extra={"uniqueItems": True},
    ),
    BeforeValidator(_ascending_unique),
]


class Quota(BaseModel):
    """A tenant's limits (null: unlimited). The tier is the tenant's, set with PATCH."""

    model_config = ConfigDict(strict=True, extra="forbid")
    budget_tokens: Count | None = DEFAULTS.budget_tokens
    budget_micros: Count | None = Field(
        default=DEFAULTS.budget_micros,
        description="A money budget in micro-units of the models' prices, over budget_period.",
    )
    budget_period: BudgetPeriod = DEFAULTS.budget_period
    max_output_tokens: Count | None = DEFAULTS.max_output_tokens
    default_max_output_tokens: Count | None = Field(
        default=DEFAULTS.default_max_output_tokens,
        description="At most max_output_tokens when both are set.",
    )
    clamp_max_output: bool = DEFAULTS.clamp_max_output
    max_prompt_tokens: Count | None = DEFAULTS.max_prompt_tokens
    rpm: Count | None = DEFAULTS.rpm
    tpm: Count | None = DEFAULTS.tpm
    allowed_models: list[ModelName] | None = None  # null: every model; []: none
    priority: PriorityClass = DEFAULTS.priority
    allow_fallback_to_small: bool = DEFAULTS.allow_fallback_to_small
    alert_thresholds: AlertThresholds | None = None  # the tenant's budgets'


class QuotaSettings(Quota):
    tier: str


class TenantCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str = Field(pattern=TENANT_ID_PATTERN)
    name: Name = ""
    tier: str = Field(default=DEFAULTS.tier, min_length=1, max_length=32, pattern=NON_BLANK_PATTERN)
    quota: Quota = Field(default_factory=Quota)


class TenantUpdate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: Name | None = None
    tier: str | None = Field(default=None, min_length=1, max_length=32, pattern=NON_BLANK_PATTERN)


class Tenant(BaseModel):
    object: Literal["tenant"] = "tenant"
    id: str
    name: str
    tier: str
    quota: QuotaSettings
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None


class TenantList(BaseModel):
    """One page of tenants, by id."""

    object: Literal["list"] = "list"
    data: list[Tenant]
    next_cursor: str | None = Field(description="Pass as cursor for the next page; null: last.")


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: Name = ""
    priority: PriorityClass | None = None
    expires_at: UtcDateTime | None = Field(
        default=None,
        strict=False,
        description="When the key stops working: a future RFC 3339 date-time with a time zone "
        "(at most 9999-12-31T23:59:59Z); a past one is refused with 400. Null: never.",
    )


class ApiKey(BaseModel):
    """What admins see of a key: its prefix, never the key or its hash."""

    object: Literal["api_key"] = "api_key"
    id: str
    tenant_id: str
    prefix: str
    name: str
    priority: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class CreatedApiKey(ApiKey):
    key: str = Field(description="The full key: shown once, only in this response.")


class ApiKeyList(BaseModel):
    """One page of a tenant's keys, oldest first."""

    object: Literal["list"] = "list"
    data: list[ApiKey]
    next_cursor: str | None = Field(description="Pass as cursor for the next page; null: last.")


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool
