"""After a settle: has a budget crossed an alert threshold? If so, put the event in the outbox.

::

    settle (gateway.accounting.settlement)
      -> the budget's used total after it (the ledger's balance)
      -> crossed_thresholds(used_before=this process's mark, used_after, limit, thresholds)
      -> none: nothing more (no database work: the common case)
      -> some: one transaction adds an event per threshold (the outbox's unique key drops one
         this period already has, from any replica), then wakes the delivery task

A budget is named as the ledger names its balance (`BudgetRef`: tenant, level, subject,
unit), so the tenant's budgets, a key's and an end user's all take this one path. The mark is the
highest usage this process checked for the budget in the period, so consecutive checks
cover every level with no gap (see `policies.budget_alerts`); it moves only once the
events are written, so a failed write is tried again by the next settle. A process that
starts afresh has no mark: its first check covers the period from zero, and what was
already fired is dropped by the unique key. Marks are kept for the most recently checked
`MAX_MARKS` budgets (end users are unbounded); one forgotten costs one such check again.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from starlette.concurrency import run_in_threadpool

from gateway.storage import alert_outbox
from gateway.storage.database import Database
from gateway.storage.models import utc_now
from policies.budget_alerts import crossed_thresholds, threshold_level
from policies.scoped_budgets import BUDGET_SCOPES, BUDGET_UNITS, BudgetScope, BudgetUnit

logger = logging.getLogger(__name__)

EVENT_TYPE = "budget.threshold_crossed"
MAX_MARKS = 100_000


@dataclass(frozen=True)
class BudgetRef:
    """Which budget, as the ledger names its balance: ``level`` tenant (``subject`` empty),
    key (the key's id) or user (the request's ``user``, within ``tenant_id``), in ``unit``
    (a tenant may have a token budget and a money budget at once)."""

    tenant_id: str
    level: BudgetScope = "tenant"
    subject: str = ""
    unit: BudgetUnit = "tokens"

    def __post_init__(self) -> None:
        if self.level not in BUDGET_SCOPES:
            raise ValueError(f"budget level must be one of {BUDGET_SCOPES}, got {self.level!r}")
        if self.unit not in BUDGET_UNITS:
            raise ValueError(f"budget unit must be one of {BUDGET_UNITS}, got {self.unit!r}")

    @property
    def budget_id(self) -> str:
        """The tenant's id for its own budget, else the key's or end user's id."""
        return self.subject or self.tenant_id


@dataclass(frozen=True)
class BudgetReading:
    """A budget's state right after a settle: ``used`` of ``limit`` (in the budget's unit)
    over the period ``period_key`` (``"month:2026-12"``, ``"total"``)."""

    period_key: str
    limit: int
    used: int


def new_event_id() -> str:
    return f"evt_{uuid.uuid4().hex}"


class BudgetWatch:
    def __init__(
        self,
        database: Database,
        thresholds: Sequence[int],
        *,
        on_new_events: Callable[[], None] = lambda: None,
        now: Callable[[], datetime] = utc_now,
    ) -> None:
        """``thresholds``: the default for budgets that name none; ``on_new_events``: called
        after events were committed (wakes the delivery task)."""
        self._database = database
        self._thresholds = tuple(thresholds)
        self._on_new_events = on_new_events
        self._now = now
        self._marks: OrderedDict[BudgetRef, tuple[str, int]] = OrderedDict()

    async def check(
        self,
        budget: BudgetRef,
        reading: BudgetReading,
        thresholds: Sequence[int] | None = None,
    ) -> list[str]:
        """Record the thresholds ``reading`` crossed since this budget's last check (each
        once per period); returns the ids of the events written."""
        period_key, mark = self._marks.get(budget, (reading.period_key, 0))
        used_before = mark if period_key == reading.period_key else 0
        percents = self._thresholds if thresholds is None else tuple(thresholds)
        crossed = crossed_thresholds(
            used_before=used_before,
            used_after=reading.used,
            limit=reading.limit,
            thresholds=percents,
        )
        written: list[str] = []
        if crossed:
            alerts = [self._alert(budget, reading, percent) for percent in crossed]
            written = await run_in_threadpool(self._write, alerts)
            if written:
                self._on_new_events()
                logger.info(
                    "budget %s %s of tenant %s crossed %s%% of its limit (%s)",
                    budget.level,
                    budget.budget_id,
                    budget.tenant_id,
                    "%, ".join(str(p) for p in crossed),
                    reading.period_key,
                )
        self._marks[budget] = (reading.period_key, max(used_before, reading.used))
        self._marks.move_to_end(budget)
        while len(self._marks) > MAX_MARKS:
            self._marks.popitem(last=False)
        return written

    def _write(self, alerts: list[alert_outbox.NewAlert]) -> list[str]:
        with self._database.transaction() as session:
            return [alert.event_id for alert in alerts if alert_outbox.add_event(session, alert)]

    def _alert(
        self, budget: BudgetRef, reading: BudgetReading, percent: int
    ) -> alert_outbox.NewAlert:
        event_id, now = new_event_id(), self._now()
        body = {
            "id": event_id,
            "type": EVENT_TYPE,
            "created_at": now.isoformat(),
            "data": {
                "tenant_id": budget.tenant_id,
                "budget": {"level": budget.level, "id": budget.budget_id},
                "period": reading.period_key,
                "threshold_percent": percent,
                "threshold": threshold_level(reading.limit, percent),
                "limit": reading.limit,
                "used": reading.used,
                "unit": budget.unit,
            },
        }
        return alert_outbox.NewAlert(
            event_id=event_id,
            created_at=now,
            tenant_id=budget.tenant_id,
            budget_level=budget.level,
            budget_id=budget.budget_id,
            unit=budget.unit,
            period_key=reading.period_key,
            threshold_percent=percent,
            body=json.dumps(body, sort_keys=True, separators=(",", ":")),
        )
