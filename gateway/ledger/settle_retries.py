"""Settles and releases that Redis could not take, tried again in the background.

A request's settle (or release) that fails because Redis cannot answer must neither delay
the response nor be lost: ``later`` tries it again, first after ``first_delay_s`` and then
doubling up to ``max_delay_s``, until it succeeds or until half the ledger's settled-retention
period after the reservation expires (within that period a settle that did run once, its
reply lost, is not counted twice). An admission whose reply was too late may have reserved
on the server all the same; releasing it the same way frees that hold (a reservation that
never existed is released as a no-op).

At most ``max_pending`` wait at once (a long outage must not grow tasks without bound);
beyond that a hold is left to expire by itself (``reservation_ttl_s``) and a settle is
logged as lost. ``aclose`` drops the retries still waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from gateway.ledger.budget_ledger import DEFAULT_SETTLED_RETENTION_S, BudgetLedger, Reservation

logger = logging.getLogger(__name__)

DEFAULT_FIRST_DELAY_S = 0.5
DEFAULT_MAX_DELAY_S = 30.0
DEFAULT_MAX_PENDING = 10_000


class LedgerRetries:
    def __init__(
        self,
        ledger: BudgetLedger,
        *,
        first_delay_s: float = DEFAULT_FIRST_DELAY_S,
        max_delay_s: float = DEFAULT_MAX_DELAY_S,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if not 0 < first_delay_s <= max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")
        self._ledger = ledger
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self._max_pending = max_pending
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def num_pending(self) -> int:
        return len(self._tasks)

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micros: int = 0
    ) -> None:
        """Settle to ``used_tokens`` (and ``used_micros``, for money budgets; release when
        no token was used) now; if Redis fails, ``later``."""
        try:
            await self._settle(reservation, used_tokens, used_micros)
        except RedisError as exc:
            logger.warning(
                "settling reservation %s failed (%s): retrying in the background",
                reservation.reservation_id,
                exc,
            )
            self.later(reservation, used_tokens, used_micros)

    def later(self, reservation: Reservation, used_tokens: int, used_micros: int = 0) -> None:
        """Settle (``used_tokens`` > 0) or release the reservation in the background."""
        if len(self._tasks) >= self._max_pending:
            if used_tokens > 0:
                _log_lost(reservation, used_tokens)
            return
        task = asyncio.get_running_loop().create_task(
            self._retry(reservation, used_tokens, used_micros)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Give up the retries still waiting (each settle given up is logged as lost)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _settle(self, reservation: Reservation, used_tokens: int, used_micros: int) -> None:
        if used_tokens > 0:
            await self._ledger.settle(reservation, used_tokens, used_micros)
        else:
            await self._ledger.release(reservation)

    async def _retry(self, reservation: Reservation, used_tokens: int, used_micros: int) -> None:
        give_up_at = reservation.expires_at + DEFAULT_SETTLED_RETENTION_S / 2
        delay = self._first_delay_s
        try:
            while time.time() + delay < give_up_at:
                await asyncio.sleep(delay)
                try:
                    await self._settle(reservation, used_tokens, used_micros)
                    return
                except RedisError:
                    delay = min(delay * 2, self._max_delay_s)
        except asyncio.CancelledError:  # shutting down
            if used_tokens > 0:
                _log_lost(reservation, used_tokens)
            raise
        if used_tokens > 0:
            _log_lost(reservation, used_tokens)


def _log_lost(reservation: Reservation, used_tokens: int) -> None:
    logger.error(
        "reservation %s was never settled (%d tokens): the ledger's `used` is short by them "
        "until the balance is rebuilt from the usage records",
        reservation.reservation_id,
        used_tokens,
    )
