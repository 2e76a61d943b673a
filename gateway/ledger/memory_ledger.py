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

from gateway.ledger.budget_ledger import (
    DEFAULT_SETTLED_RETENTION_S,
    Balance,
    Reservation,
    check_reserve_args,
    check_used_tokens,
)
from policies.budget_admission import fits_budget

# The expiry heap is rebuilt from the live reservations once it holds this many entries
# more than twice their number (entries of finished reservations wait there for their expiry).
_HEAP_SLACK = 64


@dataclass
class _Account:
    """One (tenant, period) balance.

    What it holds is proportional to the reservations in flight, not to the requests
    served: a finished reservation leaves no trace (its entry in the expiry heap goes when
    the heap is rebuilt or emptied), and only a reservation that *expired* unfinished is
    remembered, in ``lapsed``, so that its late settle counts once.
    """

    used: int = 0
    is_known: bool = False
    reserved: int = 0
    live: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (tokens, expires)
    expiry_heap: list[tuple[float, str]] = field(default_factory=list)  # may hold finished ids
    # Expired unfinished: id -> forget_at, in expiry order (forgotten from the front)
    lapsed: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def purge(self, now: float, retention_s: float) -> None:
        """Expire reservations due at or before ``now`` (kept in ``lapsed`` for
        ``retention_s``) and forget lapsed ones whose time is up."""
        heap = self.expiry_heap
        while heap and heap[0][0] <= now:
            expires_at, reservation_id = heapq.heappop(heap)
            entry = self.live.get(reservation_id)
            if entry is not None and entry[1] == expires_at:
                del self.live[reservation_id]
                self.reserved -= entry[0]
                self.lapsed[reservation_id] = expires_at + retention_s
        while self.lapsed:
            reservation_id, forget_at = next(iter(self.lapsed.items()))
            if forget_at > now:
                break
            del self.lapsed[reservation_id]
        if len(heap) > 2 * len(self.live) + _HEAP_SLACK:
            self.expiry_heap = [(e, rid) for rid, (_, e) in self.live.items()]
            heapq.heapify(self.expiry_heap)

    def finish(self, reservation_id: str) -> bool:
        """Drop the reservation; True if this call finished it (live, or expired and still
        remembered), False if it was finished before (or is unknown to this ledger)."""
        entry = self.live.pop(reservation_id, None)
        if entry is not None:
            self.reserved -= entry[0]
            if not self.live:  # every entry left in the heap is stale
                self.expiry_heap.clear()
            return True
        return self.lapsed.pop(reservation_id, None) is not None


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
        account.purge(now, self._settled_retention_s)
        return account

    async def reserve(
        self, tenant_id: str, period_key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        check_reserve_args(limit, tokens, ttl_s)
        now = self._clock()
        account = self._account(tenant_id, period_key, now)
        if not fits_budget(
            used=account.used, reserved=account.reserved, request_tokens=tokens, limit=limit
        ):
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
        if account.finish(reservation.reservation_id):
            account.used += used_tokens

    async def release(self, reservation: Reservation) -> None:
        now = self._clock()
        account = self._account(reservation.tenant_id, reservation.period_key, now)
        account.finish(reservation.reservation_id)

    async def balance(self, tenant_id: str, period_key: str) -> Balance:
        account = self._accounts.get((tenant_id, period_key))
        if account is None:
            return Balance(used=0, reserved=0)
        account.purge(self._clock(), self._settled_retention_s)
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
