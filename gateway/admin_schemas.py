"""Request and response bodies of the admin API (pydantic), shared with its OpenAPI document."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.quota import BudgetPeriod, PriorityClass, TenantQuota

TENANT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DEFAULTS = TenantQuota()


class Quota(BaseModel):
    """A tenant's limits (null: unlimited). The tier is the tenant's, set with PATCH."""

    model_config = ConfigDict(strict=True, extra="forbid")
    budget_tokens: int | None = DEFAULTS.budget_tokens
    budget_period: BudgetPeriod = DEFAULTS.budget_period
    max_output_tokens: int | None = DEFAULTS.max_output_tokens
    default_max_output_tokens: int | None = DEFAULTS.default_max_output_tokens
    clamp_max_output: bool = DEFAULTS.clamp_max_output
    max_prompt_tokens: int | None = DEFAULTS.max_prompt_tokens
    rpm: int | None = DEFAULTS.rpm
    tpm: int | None = DEFAULTS.tpm
    allowed_models: list[str] | None = None  # null: every model; []: none
    priority: PriorityClass = DEFAULTS.priority
    allow_fallback_to_small: bool = DEFAULTS.allow_fallback_to_small


class QuotaSettings(Quota):
    tier: str


class TenantCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str = Field(pattern=TENANT_ID_PATTERN)
    name: str = Field(default="", max_length=200)
    tier: str = Field(default=DEFAULTS.tier, min_length=1, max_length=32)
    quota: Quota = Field(default_factory=Quota)


class TenantUpdate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str | None = Field(default=None, max_length=200)
    tier: str | None = Field(default=None, min_length=1, max_length=32)


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
    object: Literal["list"] = "list"
    data: list[Tenant]


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(default="", max_length=200)
    priority: PriorityClass | None = None
    expires_at: datetime | None = Field(default=None, strict=False)


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
    object: Literal["list"] = "list"
    data: list[ApiKey]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool
