"""The admin API's budgets below the tenant: an API key's and an end user's, set, read and
cleared (a tenant's own budgets are its quota's ``budget_tokens`` / ``budget_micros``)::

    GET | PUT | DELETE  /admin/keys/{key_id}/budget
    GET | PUT | DELETE  /admin/tenants/{tenant_id}/users/{user}/budget

``PUT`` takes ``{"unit": "tokens" | "micros", "limit": n, "period": "day" | "month" |
"total", "alert_thresholds": [50, 80, 100] | null}`` and replaces the budget whole; a body
that is not one is a 400 naming the field (thresholds: whole percents in 1..1000, ascending,
unique; null or absent: the ``alerts:`` settings' default).
``GET`` and ``PUT`` answer where the budget stands (`BudgetStanding`: limit, used, reserved,
remaining in the current window; a money budget's ``currency``). ``{user}`` is the
request's ``user`` field as a path segment: a user whose id holds a ``/`` cannot be named
here (an encoded one is a 400).

Like every other admin change, a change bumps the tenant's auth epoch after it is committed,
so every gateway admits the next request on it (`gateway.admission.scoped_budget_lookup`),
and ``audit`` (when given) records it in the same transaction as the change.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from redis.exceptions import RedisError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.admin_inputs import not_found, path_id, read_model
from gateway.api.admin_schemas import MAX_COUNT, AlertThresholds, Deleted
from gateway.api.budget_standing import BudgetStanding, budget_standing
from gateway.auth.epochs import AuthEpochs
from gateway.errors import ApiError, change_not_announced, invalid_request
from gateway.ledger.budget_ledger import BudgetLedger
from gateway.storage import scoped_budgets
from gateway.storage.database import Database
from gateway.storage.models import ApiKeyRow, Tenant
from openai_protocol.errors import echoed_id
from openai_protocol.field_rules import MAX_USER_CHARS
from policies.decision import Rejection
from policies.quota import BudgetPeriod
from policies.scoped_budgets import DEFAULT_CURRENCY, BudgetScope, BudgetUnit, ScopedBudget

# (session, action, (target type, target id), tenant id, before, after, now): the audit
# log's record of a change, written in the change's transaction.
AuditHook = Callable[
    [Session, str, tuple[str, str], str, BaseModel | None, BaseModel | None, datetime], None
]


def _integral(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class ScopedBudgetSettings(BaseModel):
    """A key's or end user's budget: ``limit`` in ``unit`` (tokens, or micros of the
    currency the models are priced in) over ``period``; 0 admits nothing."""

    model_config = ConfigDict(strict=True, extra="forbid")
    unit: BudgetUnit
    limit: Annotated[int, Field(ge=0, le=MAX_COUNT), BeforeValidator(_integral)]
    period: BudgetPeriod = "month"
    alert_thresholds: AlertThresholds | None = None


class ScopedBudgetView(ScopedBudgetSettings):
    """As stored, for the audit log."""

    model_config = ConfigDict(strict=True, extra="forbid")
    scope: BudgetScope
    subject: str


class BudgetAdminApi:
    def __init__(
        self,
        db: Database,
        ledger: BudgetLedger,
        now: Callable[[], datetime],
        auth_epochs: AuthEpochs | None,
        audit: AuditHook | None = None,
        currency: str = DEFAULT_CURRENCY,
    ) -> None:
        self._db = db
        self._currency = currency
        self._ledger = ledger
        self._now = now
        self._auth_epochs = auth_epochs
        self._audit = audit

    async def get_key_budget(self, request: Request) -> Response:
        """An API key's budget and where it stands in its current window.
        ---
        {params: [KeyId], 200: BudgetStanding, errors: [404]}
        """
        tenant_id, key_id = await self._key(request)
        return await self._get(tenant_id, "key", key_id)

    async def put_key_budget(self, request: Request) -> Response:
        """Set (create or replace) an API key's budget.
        ---
        {params: [KeyId], body: ScopedBudgetSettings, 200: BudgetStanding, errors: [400, 404]}
        """
        tenant_id, key_id = await self._key(request)
        return await self._put(request, tenant_id, "key", key_id)

    async def delete_key_budget(self, request: Request) -> Response:
        """Clear an API key's budget (its tenant's budgets still apply).
        ---
        {params: [KeyId], 200: Deleted, errors: [404]}
        """
        tenant_id, key_id = await self._key(request)
        return await self._delete(tenant_id, "key", key_id)

    async def get_user_budget(self, request: Request) -> Response:
        """An end user's budget and where it stands in its current window.
        ---
        {params: [TenantId, User], 200: BudgetStanding, errors: [400, 404]}
        """
        tenant_id, user = await self._user(request)
        return await self._get(tenant_id, "user", user)

    async def put_user_budget(self, request: Request) -> Response:
        """Set (create or replace) an end user's budget within a tenant.
        ---
        {params: [TenantId, User], body: ScopedBudgetSettings, 200: BudgetStanding,
         errors: [400, 404]}
        """
        tenant_id, user = await self._user(request)
        return await self._put(request, tenant_id, "user", user)

    async def delete_user_budget(self, request: Request) -> Response:
        """Clear an end user's budget.
        ---
        {params: [TenantId, User], 200: Deleted, errors: [400, 404]}
        """
        tenant_id, user = await self._user(request)
        return await self._delete(tenant_id, "user", user)

    async def _key(self, request: Request) -> tuple[str, str]:
        """The key's (tenant id, key id); a 404 for a key that does not exist."""
        key_id = path_id(request, "key_id", "API key")

        def tenant_of() -> str | None:
            with self._db.session() as session:
                row = session.get(ApiKeyRow, key_id)
                return None if row is None else row.tenant_id

        tenant_id = await run_in_threadpool(tenant_of)
        if tenant_id is None:
            raise not_found("API key", key_id)
        return tenant_id, key_id

    async def _user(self, request: Request) -> tuple[str, str]:
        """The (tenant id, end user); a 404 for a tenant that does not exist or is deleted."""
        tenant_id = path_id(request, "tenant_id", "tenant")
        user = path_id(request, "user", "user")
        if not 0 < len(user) <= MAX_USER_CHARS:
            raise invalid_request(
                f"Invalid 'user': 1 to {MAX_USER_CHARS} characters, as a request's user.",
                param="user",
            )

        def is_live() -> bool:
            with self._db.session() as session:
                row = session.get(Tenant, tenant_id)
                return row is not None and row.deleted_at is None

        if not await run_in_threadpool(is_live):
            raise not_found("tenant", tenant_id)
        return tenant_id, user

    async def _get(self, tenant_id: str, scope: BudgetScope, subject: str) -> Response:
        def read() -> ScopedBudget | None:
            with self._db.session() as session:
                return scoped_budgets.get_budget(session, tenant_id, scope, subject)

        budget = await run_in_threadpool(read)
        if budget is None:
            raise _no_budget(scope, subject)
        return await self._standing(tenant_id, budget)

    async def _put(
        self, request: Request, tenant_id: str, scope: BudgetScope, subject: str
    ) -> Response:
        body = await read_model(request, ScopedBudgetSettings)
        thresholds = None if body.alert_thresholds is None else tuple(body.alert_thresholds)
        budget = ScopedBudget(scope, body.unit, body.limit, body.period, subject, thresholds)
        now = self._now()

        def write() -> None:
            with self._db.transaction() as session:
                before = scoped_budgets.get_budget(session, tenant_id, scope, subject)
                scoped_budgets.put_budget(session, tenant_id, budget)
                self._record(session, "budget.set", tenant_id, before, budget, now)

        await run_in_threadpool(write)
        await self._changed(tenant_id)
        return await self._standing(tenant_id, budget)

    async def _delete(self, tenant_id: str, scope: BudgetScope, subject: str) -> Response:
        now = self._now()

        def clear() -> bool:
            with self._db.transaction() as session:
                before = scoped_budgets.get_budget(session, tenant_id, scope, subject)
                if before is None:
                    return False
                scoped_budgets.delete_budget(session, tenant_id, scope, subject)
                self._record(session, "budget.clear", tenant_id, before, None, now)
                return True

        if not await run_in_threadpool(clear):
            raise _no_budget(scope, subject)
        await self._changed(tenant_id)
        deleted = Deleted(id=subject, object=f"{scope}.budget", deleted=True)
        return JSONResponse(deleted.model_dump(mode="json"))

    async def _standing(self, tenant_id: str, budget: ScopedBudget) -> Response:
        standing: BudgetStanding = await budget_standing(
            self._db, self._ledger, tenant_id, budget, self._now(), self._currency
        )
        return JSONResponse(standing.model_dump(mode="json"))

    def _record(
        self,
        session: Session,
        action: str,
        tenant_id: str,
        before: ScopedBudget | None,
        after: ScopedBudget | None,
        now: datetime,
    ) -> None:
        if self._audit is None:
            return
        budget = after or before
        if budget is None:  # not a change
            return
        target = (f"{budget.scope}_budget", budget.subject)
        self._audit(session, action, target, tenant_id, _view(before), _view(after), now)

    async def _changed(self, tenant_id: str) -> None:
        """Announce the committed change, as every admin change is (``admin_api``)."""
        if self._auth_epochs is not None:
            try:
                await self._auth_epochs.bump(tenant_id)
            except RedisError:
                raise change_not_announced() from None


def _view(budget: ScopedBudget | None) -> ScopedBudgetView | None:
    if budget is None:
        return None
    return ScopedBudgetView(
        unit=budget.unit,
        limit=budget.limit,
        period=budget.period,
        scope=budget.scope,
        subject=budget.subject,
        alert_thresholds=None if budget.alert_thresholds is None else list(budget.alert_thresholds),
    )


def _no_budget(scope: BudgetScope, subject: str) -> ApiError:
    what = "API key" if scope == "key" else "end user"
    message = f"No budget for {what} {echoed_id(subject)!r}."
    return ApiError(Rejection(404, "budget_not_found", "not_found_error", message))
