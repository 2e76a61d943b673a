"""The admin API's records of what happened: the audit log and the budget alerts' events.

``GET /admin/audit-log``: every admin change, newest first (``tenant_id``, ``start`` and
``end`` filter; ``limit`` and ``cursor`` page, ``cursor`` being the ``next_cursor`` of the
page before). ``GET /admin/alert-events``: budget alerts with their delivery state
(``pending``, ``delivered``, ``failed``), newest first, filtered by ``tenant_id`` and
``state``, paged the same way. A tenant filter naming no tenant answers an empty page: a
deleted tenant's history stays listed under its id.

The handlers are `admin_api`'s (``admin_routes`` puts them behind the admin key).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.admin_inputs import is_storable
from gateway.api.admin_schemas import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from gateway.api.tenant_api import check_window, parse_int, parse_time, refuse_unknown_params
from gateway.errors import invalid_request
from gateway.storage import alert_outbox, audit_log
from gateway.storage.database import Database

AUDIT_PARAMS = frozenset({"tenant_id", "start", "end", "cursor", "limit"})
ALERT_PARAMS = frozenset({"tenant_id", "state", "cursor", "limit"})


class AuditEntry(BaseModel):
    """One admin change: who made it (the admin credential's id, never the key), what, to
    which target, and the target's values before and after (null: created, or deleted)."""

    object: Literal["audit_entry"] = "audit_entry"
    id: int
    created_at: datetime
    actor: str
    action: str
    tenant_id: str | None
    target_type: str
    target_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


class AuditLog(BaseModel):
    object: Literal["list"] = "list"
    data: list[AuditEntry]
    next_cursor: int | None


class AlertEvent(BaseModel):
    """A budget alert and its delivery: ``payload`` is the JSON body the webhook gets, under
    the ``webhook-id`` ``id``."""

    object: Literal["alert_event"] = "alert_event"
    id: str
    created_at: datetime
    tenant_id: str
    budget_level: str
    budget_id: str
    unit: str
    period: str
    threshold_percent: int
    state: Literal["pending", "delivered", "failed"]
    num_attempts: int
    next_attempt_at: datetime | None
    last_error: str | None
    delivered_at: datetime | None
    cursor: int
    payload: dict[str, Any]


class AlertEventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AlertEvent]
    next_cursor: int | None


class AdminRecordsApi:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def audit_log(self, request: Request) -> Response:
        """Admin changes, newest first, a page at a time.
        ---
        {params: [TenantFilter, Start, End, RecordCursor, PageLimit], 200: AuditLog,
         errors: [400]}
        """
        params = request.query_params
        refuse_unknown_params(params, AUDIT_PARAMS)
        start, end = parse_time(params, "start"), parse_time(params, "end")
        check_window(start, end)
        cursor = parse_int(params, "cursor", 0, 2**63 - 1)
        limit = parse_int(params, "limit", 1, MAX_PAGE_SIZE) or DEFAULT_PAGE_SIZE
        tenant_id = params.get("tenant_id") or None
        if tenant_id is not None and not is_storable(tenant_id):
            return _json(AuditLog(data=[], next_cursor=None))  # no tenant has such an id

        def read() -> audit_log.AuditPage:
            with self._db.session() as session:
                return audit_log.audit_page(
                    session,
                    tenant_id=tenant_id,
                    start=start,
                    end=end,
                    cursor=cursor,
                    limit=limit,
                )

        page = await run_in_threadpool(read)
        data = [
            AuditEntry(
                id=r.id,
                created_at=r.created_at,
                actor=r.actor,
                action=r.action,
                tenant_id=r.tenant_id,
                target_type=r.target_type,
                target_id=r.target_id,
                before=None if r.before is None else dict(r.before),
                after=None if r.after is None else dict(r.after),
            )
            for r in page.records
        ]
        return _json(AuditLog(data=data, next_cursor=page.next_cursor))

    async def alert_events(self, request: Request) -> Response:
        """Budget alert events and their delivery state, newest first, a page at a time.
        ---
        {params: [TenantFilter, AlertState, RecordCursor, PageLimit], 200: AlertEventList,
         errors: [400]}
        """
        params = request.query_params
        refuse_unknown_params(params, ALERT_PARAMS)
        state = params.get("state")
        if state is not None and state not in alert_outbox.EVENT_STATES:
            raise invalid_request(
                f"Invalid 'state': use one of {', '.join(alert_outbox.EVENT_STATES)}, "
                f"got {state!r}.",
                param="state",
            )
        cursor = parse_int(params, "cursor", 0, 2**63 - 1)
        limit = parse_int(params, "limit", 1, MAX_PAGE_SIZE) or DEFAULT_PAGE_SIZE
        tenant_id = params.get("tenant_id") or None
        if tenant_id is not None and not is_storable(tenant_id):
            return _json(AlertEventList(data=[], next_cursor=None))  # no tenant has such an id

        def read() -> alert_outbox.AlertPage:
            with self._db.session() as session:
                return alert_outbox.alert_page(
                    session,
                    tenant_id=tenant_id,
                    state=state,
                    cursor=cursor,
                    limit=limit,
                )

        page = await run_in_threadpool(read)
        data = [_alert_view(record) for record in page.records]
        return _json(AlertEventList(data=data, next_cursor=page.next_cursor))


def _alert_view(record: alert_outbox.AlertRecord) -> AlertEvent:
    return AlertEvent(
        id=record.event_id,
        created_at=record.created_at,
        tenant_id=record.tenant_id,
        budget_level=record.budget_level,
        budget_id=record.budget_id,
        unit=record.unit,
        period=record.period_key,
        threshold_percent=record.threshold_percent,
        state=record.state,  # type: ignore[arg-type]  # the table's check constraint
        num_attempts=record.num_attempts,
        next_attempt_at=record.next_attempt_at,
        last_error=record.last_error,
        delivered_at=record.delivered_at,
        cursor=record.id,
        payload=json.loads(record.body),
    )


def _json(model: BaseModel) -> Response:
    return JSONResponse(model.model_dump(mode="json"))
