"""In-process budget ledger: the embedded default for a single gateway.

Every method runs to completion without awaiting, so on one event loop each call is atomic
(the same guarantee the Redis ledger gets from Lua). Not thread-safe: use it from the
gateway's event loop only. See ``budget_ledger`` for the semantics.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.budget_ledger import (
    DEFAULT_SETTLED_RETENTION_S,
    Balance,
    Reservation,
    check_reserve_args,
    check_used_tokens,
)


@dataclass
class _Account:
    """One (tenant, period) balance."""

    used: int = 0
    is_known: bool = False
    reserved: int = 0
    live: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (tokens, expires)
    expiry_heap: list[tuple[float, str]] = field(default_factory=list)  # may hold finished ids
    # id -> forget_at, in insertion order: forgotten lazily from the front, never early
    finished: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def purge(self, now: float) -> None:
        """Drop reservations that expired at or before ``now`` and forget old finished ids."""
        while self.expiry_heap and self.expiry_heap[0][0] <= now:
            expires_at, reservation_id = heapq.heappop(self.expiry_heap)
            entry = self.live.get(reservation_id)
            if entry is not None and entry[1] == expires_at:
                del self.live[reservation_id]
                self.reserved -= entry[0]
        while self.finished:
            reservation_id, forget_at = next(iter(self.finished.items()))
            if forget_at > now:
                break
            del self.finished[reservation_id]

    def finish(self, reservation_id: str, forget_at: float) -> bool:
        """Mark the reservation finished and drop it if live; False if it already was."""
        if reservation_id in self.finished:
            return False
        self.finished[reservation_id] = forget_at
        entry = self.live.pop(reservation_id, None)
        if entry is not None:
            self.reserved -= entry[0]
        return True


class MemoryBudgetLedger:
    """``BudgetLedger`` kept in a dict; ``clock`` returns unix seconds (injectable for tests)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        settled_retention_s: float = DEFAULT_SETTLED_RETENTION_S,
    ) -> None:
        if not settled_retention_s > 0:
            raise ValueError(f"settled_retention_s must be > 0, got {settled_retention_s}")
        self._clock = clock
        self._settled_retention_s = settled_retention_s
        self._accounts: dict[tuple[str, str], _Account] = {}

    def _account(self, tenant_id: str, period_key: str, now: float) -> _Account:
        account = self._accounts.setdefault((tenant_id, period_key), _Account())
        account.purge(now)
        return account

    async def reserve(
        self, tenant_id: str, period_key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        check_reserve_args(limit, tokens, ttl_s)
        now = self._clock()
        account = self._account(tenant_id, period_key, now)
        if account.used + account.reserved + tokens > limit:
            return None
        reservation_id = uuid.uuid4().hex
        expires_at = now + ttl_s
        account.live[reservation_id] = (tokens, expires_at)
        account.reserved += tokens
        heapq.heappush(account.expiry_heap, (expires_at, reservation_id))
        return Reservation(reservation_id, tenant_id, period_key, tokens, expires_at)

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        check_used_tokens(used_tokens)
        now = self._clock()
        account = self._account(reservation.tenant_id, reservation.period_key, now)
        if account.finish(reservation.reservation_id, self._forget_at(reservation, now)):
            account.used += used_tokens

    async def release(self, reservation: Reservation) -> None:
        now = self._clock()
        account = self._account(reservation.tenant_id, reservation.period_key, now)
        account.finish(reservation.reservation_id, self._forget_at(reservation, now))

    async def balance(self, tenant_id: str, period_key: str) -> Balance:
        account = self._accounts.get((tenant_id, period_key))
        if account is None:
            return Balance(used=0, reserved=0)
        account.purge(self._clock())
        return Balance(used=account.used, reserved=account.reserved)

    async def rebuild(self, tenant_id: str, period_key: str, used_tokens: int) -> bool:
        check_used_tokens(used_tokens)
        account = self._account(tenant_id, period_key, self._clock())
        if account.is_known:
            return False
        account.used = used_tokens
        account.is_known = True
        return True

    async def is_known(self, tenant_id: str, period_key: str) -> bool:
        account = self._accounts.get((tenant_id, period_key))
        return account is not None and account.is_known

    def _forget_at(self, reservation: Reservation, now: float) -> float:
        # Counted from expiry too, so a late settle retried soon after still finds the id.
        return max(now, reservation.expires_at) + self._settled_retention_s
