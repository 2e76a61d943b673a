"""The budgets of a request's API key and end user, from memory, as fresh as its auth epoch.

A request's key budget and end-user budget (``gateway.storage.scoped_budgets``) are read
once and kept beside the tenant's auth epoch they were read under, as the key cache keeps
keys (``gateway.auth.key_cache``): the admin API bumps the epoch after it commits a budget
change, the admission step compares the epoch in the same call that counts the request, and
a request that finds it moved reads its key again and plans afresh, which reads the budgets
again here (the cached entry names the old epoch)::

    (tenant, scope, subject) -> (epoch, read at, budget or None)
    hit: same epoch, younger than ttl_s ─► the cached budget (None: no budget)
    miss: read both from the database (one query, in a worker thread) ─► cache under epoch

``ttl_s`` bounds how long a change made straight in the database goes unseen. The database
unreachable: an entry of the same epoch is served however old it is (a budget is never
dropped because the database is down); without one the request gets a 503, as a key never
seen does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from sqlalchemy.exc import SQLAlchemyError

from gateway.auth.bearer_keys import auth_unavailable
from gateway.storage.database import Database
from gateway.storage.scoped_budgets import get_budgets
from policies.scoped_budgets import BudgetScope, ScopedBudget

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class _Entry:
    epoch: str
    read_at: float
    budget: ScopedBudget | None


class ScopedBudgetLookup:
    def __init__(
        self,
        database: Database,
        *,
        ttl_s: float,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self._database = database
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._entries: dict[tuple[str, BudgetScope, str], _Entry] = {}

    async def budgets(
        self, tenant_id: str, epoch: str, key_id: str | None, end_user: str | None
    ) -> tuple[ScopedBudget, ...]:
        """The key's budget then the end user's, those that exist."""
        now = self._clock()
        key_entry = self._fresh(tenant_id, "key", key_id, epoch, now)
        user_entry = self._fresh(tenant_id, "user", end_user, epoch, now)
        if key_entry is None or user_entry is None:
            try:
                key_budget, user_budget = await anyio.to_thread.run_sync(
                    self._read, tenant_id, key_id, end_user
                )
            except SQLAlchemyError as exc:
                key_entry = key_entry or self._stale(tenant_id, "key", key_id, epoch)
                user_entry = user_entry or self._stale(tenant_id, "user", end_user, epoch)
                if key_entry is None or user_entry is None:
                    logger.warning("reading the budgets of tenant %s failed: %s", tenant_id, exc)
                    raise auth_unavailable() from None
            else:
                key_entry = self._store(tenant_id, "key", key_id, _Entry(epoch, now, key_budget))
                user_entry = self._store(
                    tenant_id, "user", end_user, _Entry(epoch, now, user_budget)
                )
        return tuple(e.budget for e in (key_entry, user_entry) if e.budget is not None)

    def _fresh(
        self, tenant_id: str, scope: BudgetScope, subject: str | None, epoch: str, now: float
    ) -> _Entry | None:
        if subject is None:
            return _NONE
        entry = self._entries.get((tenant_id, scope, subject))
        if entry is None or entry.epoch != epoch or now - entry.read_at >= self._ttl_s:
            return None
        return entry

    def _stale(
        self, tenant_id: str, scope: BudgetScope, subject: str | None, epoch: str
    ) -> _Entry | None:
        if subject is None:
            return _NONE
        entry = self._entries.get((tenant_id, scope, subject))
        return entry if entry is not None and entry.epoch == epoch else None

    def _store(
        self, tenant_id: str, scope: BudgetScope, subject: str | None, entry: _Entry
    ) -> _Entry:
        if subject is None:
            return _NONE
        if len(self._entries) >= self._max_entries:
            self._entries.clear()
        self._entries[tenant_id, scope, subject] = entry
        return entry

    def _read(
        self, tenant_id: str, key_id: str | None, end_user: str | None
    ) -> tuple[ScopedBudget | None, ScopedBudget | None]:
        with self._database.session() as session:
            return get_budgets(session, tenant_id, key_id, end_user)


_NONE = _Entry("", 0.0, None)  # no subject: no budget
