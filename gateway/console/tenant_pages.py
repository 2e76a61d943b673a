"""The admin's tenant pages: the list (with this month's spend, and a form to create one),
and one tenant (budget bars, the quota editor, key and end-user budgets, keys: create, shown
once, revoke).

Every change is one transaction that also writes its audit entry (`storage.audit_log`, who:
the admin through the console), then bumps the tenant's auth epoch so every gateway's key
cache sees it, as the admin API does. A form with errors is shown again with each error
beside its field (400). A new key is in the answer to the POST that made it, and nowhere
else: not in a redirect's URL, not in a log line, not in the audit log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from redis.exceptions import RedisError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from gateway.console.console_auth import ConsoleDenied
from gateway.console.console_context import ConsoleContext
from gateway.console.console_forms import (
    FormResult,
    budget_from_form,
    key_to_create,
    quota_from_form,
    tenant_to_create,
)
from gateway.console.console_session import ConsoleSession
from gateway.console.page_queries import tenant_spend
from gateway.console.tenant_overview import TenantOverview, stored_quota, tenant_overview
from gateway.storage import api_keys, audit_log, scoped_budgets, tenants
from gateway.storage.models import ApiKeyRow
from policies.budget_period import budget_window
from policies.quota import TenantQuota
from policies.scoped_budgets import format_money

logger = logging.getLogger(__name__)
TENANTS_PER_PAGE = 50
ACTOR = "admin-key (console)"
T = TypeVar("T")


class TenantPages:
    def __init__(self, context: ConsoleContext) -> None:
        self._context = context

    async def list_page(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        return await self._list(request, session, FormResult({}), status_code=200)

    async def create(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        form = await self._context.guard.form(request, session)
        body, result = tenant_to_create(form)
        if body is None:
            return await self._list(request, session, result, status_code=400)
        now = self._context.now()

        def create(db: Session) -> tenants.TenantInfo:
            quota = TenantQuota(tier=body.tier).to_dict()  # as the admin API stores one
            info = tenants.create_tenant(
                db, body.id, name=body.name, tier=body.tier, quota=quota, now=now
            )
            self._audit(db, "tenant.created", "tenant", info.id, info.id, None, _tenant(info), now)
            return info

        try:
            info = await self._transaction(create)
        except (tenants.TenantExistsError, IntegrityError):
            taken = FormResult(result.values, {"id": f"Tenant id {body.id!r} is taken."})
            return await self._list(request, session, taken, status_code=400)
        logger.info("console: created tenant %s", info.id)
        return RedirectResponse(f"/ui/tenants/{info.id}", status_code=303)

    async def tenant_page(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        return await self._tenant(request, session, _tenant_id(request))

    async def put_quota(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        form = await self._context.guard.form(request, session)
        tenant_id = _tenant_id(request)
        overview = await self._overview(tenant_id)
        quota, result = quota_from_form(form, overview.quota)
        if quota is None:
            return await self._tenant(request, session, tenant_id, quota_form=result, status=400)
        now = self._context.now()
        before = overview.quota.to_dict()

        def put(db: Session) -> None:
            tenants.update_tenant(db, tenant_id, quota=quota.to_dict(), now=now)
            self._audit(
                db, "quota.replaced", "quota", tenant_id, tenant_id, before, quota.to_dict(), now
            )

        await self._transaction(put)
        await self._changed(tenant_id)
        return RedirectResponse(f"/ui/tenants/{tenant_id}", status_code=303)

    async def put_budget(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        form = await self._context.guard.form(request, session)
        tenant_id = _tenant_id(request)
        overview = await self._overview(tenant_id)
        key_ids = frozenset(key.id for key in overview.keys)
        budget, result = budget_from_form(form, key_ids)
        if budget is None:
            return await self._tenant(request, session, tenant_id, budget_form=result, status=400)
        now = self._context.now()
        before = next(
            (
                _budget(b.budget)
                for b in overview.budgets
                if (b.budget.scope, b.budget.subject) == (budget.scope, budget.subject)
            ),
            None,
        )

        def put(db: Session) -> None:
            stored = scoped_budgets.put_budget(db, tenant_id, budget)
            target = f"{budget.scope}:{budget.subject}"
            self._audit(db, "budget.set", "budget", target, tenant_id, before, _budget(stored), now)

        await self._transaction(put)
        await self._changed(tenant_id)
        return RedirectResponse(f"/ui/tenants/{tenant_id}", status_code=303)

    async def create_key(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        form = await self._context.guard.form(request, session)
        tenant_id = _tenant_id(request)
        body, result = key_to_create(form)
        if body is None:
            return await self._tenant(request, session, tenant_id, key_form=result, status=400)
        now = self._context.now()

        def create(db: Session) -> api_keys.CreatedKey:
            try:
                created = api_keys.create_key(db, tenant_id, name=body.name, now=now)
            except LookupError:
                raise ConsoleDenied(404, f"No tenant {tenant_id!r}.") from None
            self._audit(
                db,
                "key.created",
                "api_key",
                created.info.id,
                tenant_id,
                None,
                _key(created.info),
                now,
            )
            return created

        created = await self._transaction(create)
        await self._changed(tenant_id)
        logger.info("console: created API key %s for tenant %s", created.info.id, tenant_id)
        return await self._tenant(request, session, tenant_id, new_key=created, status=201)

    async def revoke_key(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        await self._context.guard.form(request, session)
        key_id = str(request.path_params["key_id"])
        now = self._context.now()

        def revoke(db: Session) -> str:
            row = db.get(ApiKeyRow, key_id)
            if row is None:
                raise ConsoleDenied(404, f"No API key {key_id!r}.")
            before = _key(api_keys.ApiKeyInfo.from_row(row))
            if api_keys.revoke_key(db, key_id, now=now):
                after = _key(api_keys.ApiKeyInfo.from_row(row))
                self._audit(db, "key.revoked", "api_key", key_id, row.tenant_id, before, after, now)
            return row.tenant_id

        tenant_id = await self._transaction(revoke)
        await self._changed(tenant_id)
        logger.info("console: revoked API key %s", key_id)
        return RedirectResponse(f"/ui/tenants/{tenant_id}", status_code=303)

    async def _list(
        self, request: Request, session: ConsoleSession, create_form: FormResult, status_code: int
    ) -> Response:
        cursor = request.query_params.get("cursor") or None
        now = self._context.now()
        month = budget_window("month", now)

        def read(db: Session) -> tuple[tenants.TenantPage, dict[str, Any]]:
            page = tenants.tenant_page(
                db, include_deleted=False, cursor=cursor, limit=TENANTS_PER_PAGE
            )
            ids = [info.id for info in page.tenants]
            start, end = month.start or now, month.end or now
            return page, tenant_spend(db, ids, start, end)

        page, spend = await self._read(read)
        return self._context.render(
            request,
            "tenants.html",
            session,
            status_code=status_code,
            page=page,
            spend=spend,
            form=create_form,
        )

    async def _tenant(
        self,
        request: Request,
        session: ConsoleSession,
        tenant_id: str,
        *,
        quota_form: FormResult | None = None,
        budget_form: FormResult | None = None,
        key_form: FormResult | None = None,
        new_key: api_keys.CreatedKey | None = None,
        status: int = 200,
    ) -> Response:
        overview = await self._overview(tenant_id)
        return self._context.render(
            request,
            "tenant.html",
            session,
            status_code=status,
            overview=overview,
            now=self._context.now(),
            quota_form=quota_form or FormResult(_quota_values(overview)),
            budget_form=budget_form
            or FormResult({"scope": "key", "unit": "money", "period": "month"}),
            key_form=key_form or FormResult({}),
            new_key=new_key,
        )

    async def _overview(self, tenant_id: str) -> TenantOverview:
        now = self._context.now()
        found = await self._read(lambda db: tenant_overview(db, tenant_id, now))
        if found is None:
            raise ConsoleDenied(404, f"No tenant {tenant_id!r}.")
        return found

    async def _changed(self, tenant_id: str) -> None:
        try:
            await self._context.epochs.bump(tenant_id)
        except RedisError as exc:
            logger.warning("console: announcing a change of tenant %s failed: %s", tenant_id, exc)
            raise ConsoleDenied(
                503, "Saved, but the other gateways could not be told yet: retry the change."
            ) from None

    async def _transaction(self, work: Callable[[Session], T]) -> T:
        def run() -> T:
            with self._context.database.transaction() as db:
                return work(db)

        return await run_in_threadpool(run)

    async def _read(self, work: Callable[[Session], T]) -> T:
        def run() -> T:
            with self._context.database.session() as db:
                return work(db)

        return await run_in_threadpool(run)

    @staticmethod
    def _audit(
        db: Session,
        action: str,
        target_type: str,
        target_id: str,
        tenant_id: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        now: datetime,
    ) -> None:
        audit_log.record_change(
            db,
            actor=ACTOR,
            action=action,
            target_type=target_type,
            target_id=target_id,
            tenant_id=tenant_id,
            before=before,
            after=after,
            now=now,
        )


def _tenant_id(request: Request) -> str:
    return str(request.path_params["tenant_id"])


def _quota_values(overview: TenantOverview) -> dict[str, str]:
    quota = overview.quota
    values = {
        name: "" if getattr(quota, name) is None else str(getattr(quota, name))
        for name in ("budget_tokens", "rpm", "tpm", "max_output_tokens", "max_prompt_tokens")
    }
    money = "" if quota.budget_micros is None else format_money(quota.budget_micros)
    return {
        **values,
        "budget_money": money,
        "budget_period": quota.budget_period,
        "alert_thresholds": thresholds_text(quota.alert_thresholds),
    }


def thresholds_text(thresholds: tuple[int, ...] | None) -> str:
    """``50, 80, 100`` as the forms take them; blank for the default."""
    return "" if thresholds is None else ", ".join(str(p) for p in thresholds)


def _tenant(info: tenants.TenantInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "name": info.name,
        "tier": info.tier,
        "quota": stored_quota(info).to_dict(),
    }


def _key(info: api_keys.ApiKeyInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "tenant_id": info.tenant_id,
        "prefix": info.prefix,
        "name": info.name,
        "revoked_at": None if info.revoked_at is None else info.revoked_at.isoformat(),
    }


def _budget(budget: Any) -> dict[str, Any]:
    return {
        "scope": budget.scope,
        "subject": budget.subject,
        "unit": budget.unit,
        "limit": budget.limit,
        "period": budget.period,
        "alert_thresholds": None
        if budget.alert_thresholds is None
        else list(budget.alert_thresholds),
    }
