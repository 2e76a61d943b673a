"""The admin API: tenants, quotas, API keys and usage reports, behind one admin key.

Every route needs ``Authorization: Bearer <admin key>``; the gateway keeps only the key's
SHA-256 (``admin_key_hash``) and compares hashes in constant time (`auth.admin_key`: a tenant's
API key gets 403, anything else 401). Bodies, flags and path ids are read by `admin_inputs`.
Handlers raise `ApiError` and the app's ``EXCEPTION_HANDLERS`` turn it into OpenAI's error
JSON.

A tenant's tier lives on the tenant (set on create or with PATCH) and is mirrored into its
stored quota, so the request path reads one consistent `TenantQuota`; the quota body of
``PUT .../quota`` therefore has no ``tier``. ``PUT`` replaces the whole quota: omitted fields
take `TenantQuota`'s defaults.

Tenant ids are unique regardless of case: creating ``Acme`` beside ``acme`` is a 409 naming
the existing id (ids keep their spelling; see `storage.tenants`). The tenant and key lists
are pages (``limit``, ``cursor``, ``next_cursor``), read as the usage export's.

Every change to a tenant, its quota or its keys bumps the tenant's auth epoch after it is
committed, so the gateways' key caches (``key_cache``) see it on their next request.

Every change is also written to the audit log (`storage.audit_log`) in its own transaction:
who (`admin_credential_id`, never the key), the action, the target and its admin view before
and after (a key's view has no secret and no hash). ``GET /admin/audit-log`` lists it
(`admin_records_api`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from redis.exceptions import RedisError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.api.admin_inputs import (
    is_storable,
    not_found,
    parse_bool,
    parse_page,
    path_id,
    read_model,
)
from gateway.api.admin_records_api import AdminRecordsApi
from gateway.api.admin_schemas import (
    DEFAULTS,
    ApiKey,
    ApiKeyCreate,
    ApiKeyList,
    CreatedApiKey,
    Deleted,
    Quota,
    QuotaSettings,
    Tenant,
    TenantCreate,
    TenantList,
    TenantUpdate,
)
from gateway.api.budget_admin_api import BudgetAdminApi
from gateway.api.budget_standing import standings_of
from gateway.api.tenant_api import (
    budget_status,
    parse_summary_window,
    parse_usage_query,
    refuse_unknown_params,
    usage_response,
    usage_summary,
)
from gateway.auth.admin_key import Endpoint, admin_credential_id, admin_guard
from gateway.auth.epochs import AuthEpochs, MemoryAuthEpochs
from gateway.auth.key_cache import KeyCache
from gateway.errors import ApiError, change_not_announced, invalid_request
from gateway.ledger.budget_ledger import BudgetLedger
from gateway.storage import api_keys, audit_log, tenants
from gateway.storage.database import Database
from gateway.storage.models import ApiKeyRow, utc_now
from openai_protocol.errors import echoed_id
from policies.decision import Rejection
from policies.quota import TenantQuota
from policies.scoped_budgets import DEFAULT_CURRENCY

logger = logging.getLogger(__name__)

_QUOTA_FIELDS = frozenset(f.name for f in dataclasses.fields(TenantQuota))
T = TypeVar("T")


def admin_routes(
    db: Database,
    admin_key_hash: str,
    ledger: BudgetLedger,
    now: Callable[[], datetime] = utc_now,
    *,
    auth_epochs: AuthEpochs | None = None,
    keys: KeyCache | None = None,
    currency: str = DEFAULT_CURRENCY,
) -> list[BaseRoute]:
    """The ``/admin`` routes; ``admin_key_hash`` is the SHA-256 hex of the admin key.
    ``auth_epochs``: where to announce changes to keys and quotas (none: no key cache).
    ``keys``: the gateway's key cache, which tells a tenant's API key (403) from an unknown
    key (401); none: a database read per refused request. ``currency``: the code the prices
    are in, named in the budget views."""
    key_hash = admin_key_hash.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", key_hash):
        raise ValueError(
            "admin_key_hash must be the SHA-256 hex digest (64 characters) of the admin key"
        )
    api = _AdminApi(db, ledger, now, auth_epochs, admin_credential_id(key_hash), currency)
    records = AdminRecordsApi(db)
    budgets = BudgetAdminApi(db, ledger, now, auth_epochs, audit=api._audit, currency=currency)
    guard = admin_guard(key_hash, keys or KeyCache(db, auth_epochs or MemoryAuthEpochs(), ttl_s=0))

    table: list[tuple[str, str, Endpoint]] = [
        ("/admin/tenants", "POST", api.create_tenant),
        ("/admin/tenants", "GET", api.list_tenants),
        ("/admin/tenants/{tenant_id}", "GET", api.get_tenant),
        ("/admin/tenants/{tenant_id}", "PATCH", api.update_tenant),
        ("/admin/tenants/{tenant_id}", "DELETE", api.delete_tenant),
        ("/admin/tenants/{tenant_id}/quota", "PUT", api.put_quota),
        ("/admin/tenants/{tenant_id}/budget", "GET", api.tenant_budget),
        ("/admin/tenants/{tenant_id}/keys", "POST", api.create_key),
        ("/admin/tenants/{tenant_id}/keys", "GET", api.list_keys),
        ("/admin/keys/{key_id}", "DELETE", api.revoke_key),
        ("/admin/keys/{key_id}/budget", "GET", budgets.get_key_budget),
        ("/admin/keys/{key_id}/budget", "PUT", budgets.put_key_budget),
        ("/admin/keys/{key_id}/budget", "DELETE", budgets.delete_key_budget),
        ("/admin/tenants/{tenant_id}/users/{user}/budget", "GET", budgets.get_user_budget),
        ("/admin/tenants/{tenant_id}/users/{user}/budget", "PUT", budgets.put_user_budget),
        ("/admin/tenants/{tenant_id}/users/{user}/budget", "DELETE", budgets.delete_user_budget),
        ("/admin/usage", "GET", api.usage),
        ("/admin/usage/summary", "GET", api.usage_summary),
        ("/admin/audit-log", "GET", records.audit_log),
        ("/admin/alert-events", "GET", records.alert_events),
    ]
    return [Route(path, guard(endpoint), methods=[method]) for path, method, endpoint in table]


class _AdminApi:
    """The handlers. Database work runs in a worker thread, one transaction per request."""

    def __init__(
        self,
        db: Database,
        ledger: BudgetLedger,
        now: Callable[[], datetime],
        auth_epochs: AuthEpochs | None,
        actor: str = "admin-key",
        currency: str = DEFAULT_CURRENCY,
    ) -> None:
        self._db = db
        self._ledger = ledger
        self._now = now
        self._auth_epochs = auth_epochs
        self._actor = actor  # who the audit log says made each change
        self._currency = currency

    async def _changed(self, tenant_id: str) -> None:
        """Announce a committed change to the tenant's keys or quota."""
        if self._auth_epochs is not None:
            try:
                await self._auth_epochs.bump(tenant_id)
            except RedisError as exc:
                logger.warning("announcing a change of tenant %s failed: %s", tenant_id, exc)
                raise change_not_announced() from None

    def _audit(
        self,
        session: Session,
        action: str,
        target: tuple[str, str],
        tenant_id: str,
        before: BaseModel | None,
        after: BaseModel | None,
        now: datetime,
    ) -> None:
        """Record a change in the session's transaction; ``target``: (type, id)."""
        audit_log.record_change(
            session,
            actor=self._actor,
            action=action,
            target_type=target[0],
            target_id=target[1],
            tenant_id=tenant_id,
            before=None if before is None else before.model_dump(mode="json"),
            after=None if after is None else after.model_dump(mode="json"),
            now=now,
        )

    async def _transaction(self, work: Callable[[Session], T]) -> T:
        def run() -> T:
            with self._db.transaction() as session:
                return work(session)

        return await run_in_threadpool(run)

    async def create_tenant(self, request: Request) -> Response:
        """Create a tenant.
        ---
        {body: TenantCreate, 201: Tenant, errors: [400, 409]}
        """
        body = await read_model(request, TenantCreate)
        quota = _validated_quota(body.quota, body.tier, param_prefix="quota.")
        now = self._now()

        def create(session: Session) -> tenants.TenantInfo:
            try:
                info = tenants.create_tenant(
                    session, body.id, name=body.name, tier=body.tier, quota=quota, now=now
                )
            except tenants.TenantExistsError as exc:
                raise _tenant_exists(body.id, exc.existing_id) from None
            target = ("tenant", info.id)
            self._audit(session, "tenant.created", target, info.id, None, _tenant_view(info), now)
            return info

        try:
            info = await self._transaction(create)
        except IntegrityError:  # created concurrently by another request
            raise _tenant_exists(body.id, None) from None
        logger.info("created tenant %s", info.id)
        return _json(_tenant_view(info), status_code=201)

    async def list_tenants(self, request: Request) -> Response:
        """List tenants by id, a page at a time.
        ---
        {params: [IncludeDeleted, IdCursor, PageLimit], 200: TenantList, errors: [400]}
        """
        params = request.query_params
        refuse_unknown_params(params, frozenset({"include_deleted", "cursor", "limit"}))
        include_deleted = parse_bool(params, "include_deleted")
        page_query = parse_page(params)
        page = await self._transaction(
            lambda session: tenants.tenant_page(
                session,
                include_deleted=include_deleted,
                cursor=page_query.cursor,
                limit=page_query.limit,
            )
        )
        data = [_tenant_view(info) for info in page.tenants]
        return _json(TenantList(data=data, next_cursor=page.next_cursor))

    async def get_tenant(self, request: Request) -> Response:
        """Get a tenant.
        ---
        {params: [TenantId], 200: Tenant, errors: [404]}
        """
        tenant_id = path_id(request, "tenant_id", "tenant")
        return _json(_tenant_view(await self._transaction(lambda s: _live_tenant(s, tenant_id))))

    async def update_tenant(self, request: Request) -> Response:
        """Change a tenant's name or tier.
        ---
        {params: [TenantId], body: TenantUpdate, 200: Tenant, errors: [400, 404]}
        """
        tenant_id = path_id(request, "tenant_id", "tenant")
        body = await read_model(request, TenantUpdate)
        now = self._now()

        def update(session: Session) -> tenants.TenantInfo | None:
            info = _live_tenant(session, tenant_id)
            quota = None
            if body.tier is not None:
                stored = TenantQuota.from_dict(info.quota)
                quota = _quota_dict(stored, body.tier, param_prefix="")
            updated = tenants.update_tenant(
                session, tenant_id, name=body.name, tier=body.tier, quota=quota, now=now
            )
            if updated is not None:
                before, after = _tenant_view(info), _tenant_view(updated)
                self._audit(
                    session, "tenant.updated", ("tenant", tenant_id), tenant_id, before, after, now
                )
            return updated

        info = await self._transaction(update)
        if info is None:
            raise not_found("tenant", tenant_id)
        await self._changed(tenant_id)
        return _json(_tenant_view(info))

    async def delete_tenant(self, request: Request) -> Response:
        """Delete a tenant (soft); its keys stop working at once.
        ---
        {params: [TenantId], 200: Deleted, errors: [404]}
        """
        tenant_id = path_id(request, "tenant_id", "tenant")
        now = self._now()

        def delete(session: Session) -> bool:
            before = tenants.get_tenant(session, tenant_id)
            if before is None or not tenants.delete_tenant(session, tenant_id, now=now):
                return False
            after = tenants.get_tenant(session, tenant_id, include_deleted=True)
            views = _tenant_view(before), None if after is None else _tenant_view(after)
            self._audit(session, "tenant.deleted", ("tenant", tenant_id), tenant_id, *views, now)
            return True

        if not await self._transaction(delete):
            raise not_found("tenant", tenant_id)
        await self._changed(tenant_id)
        logger.info("deleted tenant %s", tenant_id)
        return _json(Deleted(id=tenant_id, object="tenant", deleted=True))

    async def put_quota(self, request: Request) -> Response:
        """Replace a tenant's quota (omitted fields take their defaults).
        ---
        {params: [TenantId], body: Quota, 200: QuotaSettings, errors: [400, 404]}
        """
        tenant_id = path_id(request, "tenant_id", "tenant")
        body = await read_model(request, Quota)
        quota = _validated_quota(body, DEFAULTS.tier, param_prefix="")
        now = self._now()

        def put(session: Session) -> tenants.TenantInfo | None:
            before = _live_tenant(session, tenant_id)
            quota_now = {**quota, "tier": before.tier}
            info = tenants.update_tenant(session, tenant_id, quota=quota_now, now=now)
            if info is not None:
                views = _tenant_view(before).quota, _tenant_view(info).quota
                self._audit(session, "quota.replaced", ("quota", tenant_id), tenant_id, *views, now)
            return info

        info = await self._transaction(put)
        if info is None:
            raise not_found("tenant", tenant_id)
        await self._changed(tenant_id)
        return _json(_tenant_view(info).quota)

    async def tenant_budget(self, request: Request) -> Response:
        """A tenant's budget in the current window (as the tenant sees it on /v1/budget),
        with its own budgets in ``budgets`` (a key's or end user's: their budget routes).
        ---
        {params: [TenantId], 200: Budget, errors: [404]}
        """
        tenant_id = path_id(request, "tenant_id", "tenant")
        info = await self._transaction(lambda s: _live_tenant(s, tenant_id))
        quota, now = tenant_quota(info), self._now()
        status = await budget_status(self._db, self._ledger, info.id, quota, now, self._currency)
        status.budgets = await standings_of(
            self._db, self._ledger, info.id, quota, None, None, now, self._currency
        )
        return _json(status)

    async def create_key(self, request: Request) -> Response:
        """Create an API key; the key is in this response only.
        ---
        {params: [TenantId], body: ApiKeyCreate, body_optional: true, 201: CreatedApiKey,
         errors: [400, 404]}
        """
        tenant_id = path_id(request, "tenant_id", "tenant")
        is_empty = request.headers.get("content-length") == "0"
        body = ApiKeyCreate() if is_empty else await read_model(request, ApiKeyCreate)
        now = self._now()
        expires_at = body.expires_at
        if expires_at is not None and expires_at <= now:
            raise invalid_request(
                "expires_at must be in the future (a key that never worked is a mistake; "
                "to stop a key, revoke it).",
                param="expires_at",
            )

        def create(session: Session) -> api_keys.CreatedKey:
            try:
                created = api_keys.create_key(
                    session,
                    tenant_id,
                    name=body.name,
                    priority=body.priority,
                    expires_at=expires_at,
                    now=now,
                )
            except LookupError:
                raise not_found("tenant", tenant_id) from None
            view = _key_view(created.info)  # the key's metadata: never the key or its hash
            self._audit(session, "key.created", ("key", view.id), tenant_id, None, view, now)
            return created

        created = await self._transaction(create)
        await self._changed(tenant_id)  # a key refused as unknown before works at once
        logger.info("created API key %s for tenant %s", created.info.id, tenant_id)
        view = CreatedApiKey(**_key_view(created.info).model_dump(), key=created.key)
        return _json(view, status_code=201, headers={"Cache-Control": "no-store"})

    async def list_keys(self, request: Request) -> Response:
        """List a tenant's keys (revoked and expired ones too) by prefix, oldest first, a page
        at a time.
        ---
        {params: [TenantId, IdCursor, PageLimit], 200: ApiKeyList, errors: [400, 404]}
        """
        tenant_id = path_id(request, "tenant_id", "tenant")
        refuse_unknown_params(request.query_params, frozenset({"cursor", "limit"}))
        page_query = parse_page(request.query_params)

        def list_(session: Session) -> api_keys.ApiKeyPage:
            _live_tenant(session, tenant_id)
            try:
                return api_keys.key_page(
                    session, tenant_id, cursor=page_query.cursor, limit=page_query.limit
                )
            except api_keys.UnknownCursorError:
                raise invalid_request(
                    f"Invalid 'cursor': no key {echoed_id(page_query.cursor or '')!r} of "
                    f"tenant {echoed_id(tenant_id)!r}; pass the next_cursor of the page before.",
                    param="cursor",
                ) from None

        page = await self._transaction(list_)
        data = [_key_view(info) for info in page.keys]
        return _json(ApiKeyList(data=data, next_cursor=page.next_cursor))

    async def revoke_key(self, request: Request) -> Response:
        """Revoke a key at once (revoking it again changes nothing).
        ---
        {params: [KeyId], 200: ApiKey, errors: [404]}
        """
        key_id = path_id(request, "key_id", "API key")
        now = self._now()

        def revoke(session: Session) -> api_keys.ApiKeyInfo:
            row = session.get(ApiKeyRow, key_id)
            if row is None:
                raise not_found("API key", key_id)
            before = api_keys.ApiKeyInfo.from_row(row)
            api_keys.revoke_key(session, key_id, now=now)
            session.refresh(row)
            info = api_keys.ApiKeyInfo.from_row(row)
            if info != before:  # revoking a revoked key changes nothing: nothing to record
                views = _key_view(before), _key_view(info)
                self._audit(session, "key.revoked", ("key", key_id), info.tenant_id, *views, now)
            return info

        info = await self._transaction(revoke)
        await self._changed(info.tenant_id)  # also when it was revoked before: a retry
        logger.info("revoked API key %s", key_id)
        return _json(_key_view(info))

    async def usage(self, request: Request) -> Response:
        """Usage records, oldest first (JSON page, JSONL or CSV).
        ---
        {params: [TenantFilter, Start, End, Cursor, Limit, Format], 200: UsageList, streams: true,
         errors: [400, 404]}
        """
        query = parse_usage_query(request.query_params)
        tenant_id = await self._known_tenant_filter(request.query_params)
        return await usage_response(self._db, tenant_id, query)

    async def usage_summary(self, request: Request) -> Response:
        """Usage totals per tenant and served model, for a period or start/end.
        ---
        {params: [TenantFilter, Period, Start, End], 200: UsageSummary, errors: [400, 404]}
        """
        period, start, end = parse_summary_window(request.query_params, self._now())
        tenant_id = await self._known_tenant_filter(request.query_params)
        return _json(await usage_summary(self._db, tenant_id, period, start, end))

    async def _known_tenant_filter(self, params: Mapping[str, str]) -> str | None:
        tenant_id = params.get("tenant_id") or None
        if tenant_id is not None:
            if not is_storable(tenant_id):
                raise not_found("tenant", tenant_id, param="tenant_id")
            found = await self._transaction(
                lambda s: tenants.get_tenant(s, tenant_id, include_deleted=True)
            )
            if found is None:
                raise not_found("tenant", tenant_id, param="tenant_id")
        return tenant_id


def tenant_quota(info: tenants.TenantInfo) -> TenantQuota:
    """The tenant's stored quota, with the tenant's tier."""
    return dataclasses.replace(TenantQuota.from_dict(info.quota), tier=info.tier)


def _validated_quota(body: Quota, tier: str, *, param_prefix: str) -> dict[str, Any]:
    """``body`` checked by `TenantQuota` and made JSON-ready; only the fields the client set."""
    return _quota_dict(body.model_dump(exclude_unset=True), tier, param_prefix=param_prefix)


def _quota_dict(
    values: Mapping[str, Any] | TenantQuota, tier: str, *, param_prefix: str
) -> dict[str, Any]:
    if isinstance(values, TenantQuota):
        values = values.to_dict()
    try:
        return TenantQuota.from_dict({**values, "tier": tier}).to_dict()
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        param = param_prefix + field if field in _QUOTA_FIELDS else None
        if field == "tier":
            param = "tier"
        raise invalid_request(f"Invalid quota: {message}.", param=param) from None


def _live_tenant(session: Session, tenant_id: str) -> tenants.TenantInfo:
    info = tenants.get_tenant(session, tenant_id)
    if info is None:
        raise not_found("tenant", tenant_id)
    return info


def _tenant_view(info: tenants.TenantInfo) -> Tenant:
    quota = QuotaSettings.model_validate(tenant_quota(info).to_dict())
    return Tenant(
        id=info.id,
        name=info.name,
        tier=info.tier,
        quota=quota,
        created_at=info.created_at,
        updated_at=info.updated_at,
        deleted_at=info.deleted_at,
    )


def _key_view(info: api_keys.ApiKeyInfo) -> ApiKey:
    fields = {name: getattr(info, name) for name in ApiKey.model_fields if name != "object"}
    return ApiKey(**fields)


def _json(
    model: BaseModel, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return JSONResponse(model.model_dump(mode="json"), status_code=status_code, headers=headers)


def _tenant_exists(tenant_id: str, existing_id: str | None) -> ApiError:
    """409 for a taken id; ``existing_id``: the id that holds it, when known (it differs
    from ``tenant_id`` only in case if it is spelt otherwise)."""
    if existing_id is None or existing_id == tenant_id:
        message = f"Tenant {tenant_id!r} already exists"
    else:
        message = (
            f"Tenant {tenant_id!r} differs only in case from the existing tenant "
            f"{existing_id!r}; tenant ids are unique regardless of case"
        )
    return ApiError(
        Rejection(
            409,
            "tenant_exists",
            "invalid_request_error",
            f"{message} (ids of deleted tenants stay taken).",
            "id",
        )
    )
