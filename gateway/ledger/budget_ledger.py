"""Budget ledger: the one place that changes a tenant's token balance.

A balance belongs to one ``(tenant_id, period_key)`` pair; the period key is opaque here
(``"day:2025-06-01"``, ``"month:2025-06"``, ``"total"``: the caller chooses). It holds

- ``used``: tokens the engine reported as consumed (settled), and
- live reservations: ``reservation_id -> tokens``, each with an expiry.

Life of one request::

    reserve(prompt_tokens + max_tokens) ──None──> 429 insufficient_quota
        │ Reservation
        ▼
    forward to the engine ──never started──> release(reservation)   (nothing was used)
        │
        ▼
    stream ends (done, error, or client gone) ──> settle(reservation, usage.total_tokens)
        │
        └── gateway dies instead: the reservation expires after ``ttl_s`` and stops counting

Invariant (every operation is atomic, across any number of gateway replicas for the Redis
ledger): ``reserve`` admits only if ``used + reserved + tokens <= limit``, where ``reserved``
is the sum of live (unexpired, unsettled, unreleased) reservations. So as long as each request
consumes at most what it reserved and settles before its reservation expires, ``used`` never
exceeds the limit. Settlement records the engine's real usage even when it is larger than the
reservation or arrives after expiry (the tokens *were* consumed), so pick ``ttl_s`` longer than
the longest request: a reservation that expires early frees budget that a late settle then
spends a second time.

``settle`` and ``release`` are idempotent and terminal: the first of them on a reservation
wins and later calls are no-ops. A ledger forgets a reservation once it is finished, so what
it holds follows the requests in flight, not the requests served; one that *expired*
unfinished is remembered for a retention period (an hour by default) so that its late settle
counts once. A settle the ledger cannot match to a reservation it holds or remembers
(finished before, lapsed longer ago than the retention, or lost with an emptied Redis) is a
no-op: the usage record still carries those tokens.

After a restart (memory) or an emptied Redis, a balance is *unknown*: the gateway sums its
usage records and calls ``rebuild``, which sets ``used`` only if no one rebuilt it first.
``reserve`` on an unknown balance counts ``used`` as 0, so check ``is_known`` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DEFAULT_SETTLED_RETENTION_S = 3600.0


@dataclass(frozen=True)
class Reservation:
    """Tokens held for one in-flight request; ``expires_at`` is unix seconds (ledger clock)."""

    reservation_id: str
    tenant_id: str
    period_key: str
    tokens: int
    expires_at: float


@dataclass(frozen=True)
class Balance:
    """``used``: settled tokens; ``reserved``: tokens held by live reservations."""

    used: int
    reserved: int

    def remaining(self, limit: int) -> int:
        """Tokens a new reservation may still take under ``limit`` (never negative)."""
        return max(0, limit - self.used - self.reserved)


class BudgetLedger(Protocol):
    """Token balances per (tenant, period). Implementations: memory and Redis."""

    async def reserve(
        self, tenant_id: str, period_key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        """Hold ``tokens`` if ``used + reserved + tokens <= limit``; ``None`` means refuse."""
        ...

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Drop the reservation and add ``used_tokens`` to ``used``. Idempotent."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Drop the reservation without recording usage (cancelled before any use)."""
        ...

    async def balance(self, tenant_id: str, period_key: str) -> Balance:
        """The current balance; expired reservations are not counted."""
        ...

    async def rebuild(self, tenant_id: str, period_key: str, used_tokens: int) -> bool:
        """Set ``used`` from the usage records if the balance is unknown; True if it did."""
        ...

    async def is_known(self, tenant_id: str, period_key: str) -> bool:
        """Whether the balance was rebuilt since the store was last empty."""
        ...


def check_reserve_args(limit: int, tokens: int, ttl_s: float) -> None:
    """Raise ``ValueError`` for arguments no implementation accepts."""
    if limit < 0:
        raise ValueError(f"budget limit must be >= 0, got {limit}")
    if tokens <= 0:
        raise ValueError(f"a reservation must hold at least one token, got {tokens}")
    if not ttl_s > 0:
        raise ValueError(f"reservation ttl_s must be > 0, got {ttl_s}")


def check_used_tokens(used_tokens: int) -> None:
    if used_tokens < 0:
        raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
