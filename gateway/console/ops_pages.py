"""The admin's operations pages: the fleet (replicas, load, latency, errors, rollout
weights) and the audit log beside the budget alerts' events, each a page at a time newest
first (the audit log from `storage.audit_log`, the events from `storage.alert_outbox`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from gateway.console.console_auth import ConsoleDenied
from gateway.console.console_context import ConsoleContext
from gateway.console.fleet_view import FleetView, fleet_view
from gateway.storage import alert_outbox, audit_log

ENTRIES_PER_PAGE = 50


class OpsPages:
    def __init__(self, context: ConsoleContext) -> None:
        self._context = context

    async def fleet_page(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        sources = self._context.fleet
        view = (
            FleetView([], [])
            if sources is None
            else fleet_view(
                sorted(self._context.gateway.models),
                sources.replica_set,
                sources.prefix_index,
                sources.registry,
                sources.rollouts.table,
            )
        )
        return self._context.render(request, "fleet.html", session, fleet=view)

    async def audit_page(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        audit_cursor = _cursor(request, "audit_cursor")
        alert_cursor = _cursor(request, "alert_cursor")

        def read() -> tuple[audit_log.AuditPage, alert_outbox.AlertPage]:
            with self._context.database.session() as db:
                audit = audit_log.audit_page(
                    db, tenant_id=None, start=None, end=None, cursor=audit_cursor,
                    limit=ENTRIES_PER_PAGE,
                )  # fmt: skip
                alerts = alert_outbox.alert_page(
                    db, tenant_id=None, state=None, cursor=alert_cursor, limit=ENTRIES_PER_PAGE
                )
            return audit, alerts

        audit, alerts = await run_in_threadpool(read)
        return self._context.render(
            request, "audit.html", session, audit=audit, alerts=alerts, as_json=_as_json
        )


def _cursor(request: Request, name: str) -> int | None:
    text = request.query_params.get(name)
    if not text:
        return None
    if not text.isdigit() or len(text) > 19:
        raise ConsoleDenied(400, f"Invalid {name!r}: use the link to the next page.")
    return int(text)


def _as_json(values: Any) -> str:
    return "" if values is None else json.dumps(values, sort_keys=True, default=str)
