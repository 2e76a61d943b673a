"""In-process budget ledger: the embedded default for a single gateway.

Every method runs to completion without awaiting, so on one event loop each call is atomic
(the same guarantee the Redis ledger gets from Lua): ``reserve_all`` checks every balance
before it holds anything in any. Not thread-safe: use it from the
gateway's event loop only. See ``budget_ledger`` for the semantics.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.ledger.budget_ledger import (
    DEFAULT_SETTLED_RETENTION_S,
    TENANT_TOKENS,
    Balance,
    BudgetAccount,
    Hold,
    HoldAsk,
    Refused,
    Reservation,
    charged,
    check_asks,
    check_reserve_args,
    check_used_tokens,
)
from policies.budget_admission import fits_budget

# The expiry heap is rebuilt from the live reservations once it holds this many entries
# more than twice their number (entries of finished reservations wait there for their expiry).
_HEAP_SLACK = 64

# A tenant's token balance is keyed as it always was, without the account (hashing one costs
# more than the rest of the key); every other balance names its account.
_AccountKey = tuple[str, str] | tuple[str, str, BudgetAccount]


def _key(tenant_id: str, account: BudgetAccount, period_key: str) -> _AccountKey:
    if account is TENANT_TOKENS or account == TENANT_TOKENS:
        return tenant_id, period_key
    return tenant_id, period_key, account


@dataclass
class _Account:
    """One (tenant, account, period) balance.

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

    def hold(self, reservation_id: str, amount: int, expires_at: float) -> None:
        self.live[reservation_id] = (amount, expires_at)
        self.reserved += amount
        heapq.heappush(self.expiry_heap, (expires_at, reservation_id))

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
        self._accounts: dict[_AccountKey, _Account] = {}

    def _account(
        self, tenant_id: str, account: BudgetAccount, period_key: str, now: float
    ) -> _Account:
        balance = self._accounts.setdefault(_key(tenant_id, account, period_key), _Account())
        balance.purge(now, self._settled_retention_s)
        return balance

    async def reserve(
        self, tenant_id: str, period_key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        check_reserve_args(limit, tokens, ttl_s)
        now = self._clock()
        balance = self._account(tenant_id, TENANT_TOKENS, period_key, now)
        if not fits_budget(
            used=balance.used, reserved=balance.reserved, request_tokens=tokens, limit=limit
        ):
            return None
        reservation_id = uuid.uuid4().hex
        expires_at = now + ttl_s
        balance.hold(reservation_id, tokens, expires_at)
        return Reservation(reservation_id, tenant_id, period_key, tokens, expires_at)

    async def reserve_all(
        self, tenant_id: str, asks: Sequence[HoldAsk], ttl_s: float
    ) -> Reservation | Refused:
        check_asks(asks, ttl_s)
        now = self._clock()
        balances = [self._account(tenant_id, a.account, a.period_key, now) for a in asks]
        for index, (ask, balance) in enumerate(zip(asks, balances, strict=True)):
            if not fits_budget(
                used=balance.used,
                reserved=balance.reserved,
                request_tokens=ask.amount,
                limit=ask.limit,
            ):
                return Refused(index, Balance(used=balance.used, reserved=balance.reserved))
        reservation_id = uuid.uuid4().hex
        expires_at = now + ttl_s
        for ask, balance in zip(asks, balances, strict=True):
            balance.hold(reservation_id, ask.amount, expires_at)
        first, more = asks[0], asks[1:]
        return Reservation(
            reservation_id,
            tenant_id,
            first.period_key,
            first.amount,
            expires_at,
            first.account,
            tuple(Hold(a.account, a.period_key, a.amount) for a in more),
        )

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micros: int = 0
    ) -> None:
        check_used_tokens(used_tokens)
        check_used_tokens(used_micros)
        now = self._clock()
        tenant_id, reservation_id = reservation.tenant_id, reservation.reservation_id
        if not reservation.more:  # the common case, kept to one balance's work
            account = reservation.account
            balance = self._account(tenant_id, account, reservation.period_key, now)
            if balance.finish(reservation_id):
                balance.used += used_micros if account.unit == "micros" else used_tokens
            return
        for hold in reservation.holds:
            balance = self._account(tenant_id, hold.account, hold.period_key, now)
            if balance.finish(reservation_id):
                balance.used += charged(hold, used_tokens, used_micros)

    async def release(self, reservation: Reservation) -> None:
        now = self._clock()
        for hold in reservation.holds:
            balance = self._account(reservation.tenant_id, hold.account, hold.period_key, now)
            balance.finish(reservation.reservation_id)

    async def balance(
        self, tenant_id: str, period_key: str, account: BudgetAccount = TENANT_TOKENS
    ) -> Balance:
        balance = self._accounts.get(_key(tenant_id, account, period_key))
        if balance is None:
            return Balance(used=0, reserved=0)
        balance.purge(self._clock(), self._settled_retention_s)
        return Balance(used=balance.used, reserved=balance.reserved)

    async def rebuild(
        self,
        tenant_id: str,
        period_key: str,
        used_tokens: int,
        account: BudgetAccount = TENANT_TOKENS,
    ) -> bool:
        check_used_tokens(used_tokens)
        balance = self._account(tenant_id, account, period_key, self._clock())
        if balance.is_known:
            return False
        balance.used = used_tokens
        balance.is_known = True
        return True

    async def is_known(
        self, tenant_id: str, period_key: str, account: BudgetAccount = TENANT_TOKENS
    ) -> bool:
        balance = self._accounts.get(_key(tenant_id, account, period_key))
        return balance is not None and balance.is_known
