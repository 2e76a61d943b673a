"""The admission step in Redis: one Lua script, one round trip (see ``admission_store``).

The script is the ledger's and the rate-limit store's own Lua functions run back to back
after the auth-epoch check, so balances, windows and epochs keep one definition each. Every
key it touches carries the tenant's hash tag (one cluster slot)::

    KEYS: budget account, reservations, reservation_tokens, lapsed, auth epoch, hits, tokens,
          then four per budget of ``more_budgets`` (the ledger's keys of each balance)
    ARGV: epoch, budget limit (-1: none), tokens, ttl_ms, id, now_ms, window_ms, rpm, tpm
          (-1: none), rate-limited (1/0), number of more budgets, then limit and amount of each

Every balance asked is checked before any is held (all or none). With only the tenant's
token budget the script does what it did before: one balance, one round trip.

Ids (reservation, and rate-limit member ``<id>:<tokens>``) are a random per-store prefix and a
counter: unique across replicas without a call to the OS random source per request.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.admission.admission_store import (
    AdmissionAsk,
    AdmissionResult,
    AdmissionTimedOut,
    AuthChanged,
    BalanceUnknown,
    Counted,
)
from gateway.auth.epochs import auth_epoch_key
from gateway.ledger.budget_ledger import (
    TENANT_TOKENS,
    Balance,
    BudgetAccount,
    Hold,
    Reservation,
    check_asks,
    check_reserve_args,
)
from gateway.ledger.redis_ledger import LEDGER_FUNCTIONS, BudgetKeys
from gateway.ratelimit.rate_limit_store import (
    DEFAULT_WINDOW_S,
    check_hit_args,
    check_window,
)
from gateway.ratelimit.redis_window import HIT_FUNCTION, rate_limit_keys, window_state
from gateway.storage.redis_client import RedisCommands

_MAX_CACHED_KEYS = 10_000
_NO_BUDGET_PERIOD = "-"  # names budget keys the script never touches when no budget is asked

# Replies: {1, epoch} auth changed; {2, index} balance unknown; {0, window or 0, expires_at or
# -1, used, reserved, index} counted (used, reserved and the index of the budget that refused
# only when one did; index 0 is the tenant's token budget, j the j-th of more_budgets).
_ADMIT = (
    LEDGER_FUNCTIONS
    + HIT_FUNCTION
    + """
local epoch = redis.call('GET', KEYS[5]) or ''
if epoch ~= ARGV[1] then
  return {1, epoch}
end
local limit, tokens, ttl_ms, id = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local more = tonumber(ARGV[11])
if limit >= 0 then
  purge()
  if redis.call('HEXISTS', account, 'known') == 0 then
    return {2, 0}
  end
end
for j = 1, more do
  use(4 + 4 * j)
  purge()
  if redis.call('HEXISTS', account, 'known') == 0 then
    return {2, j}
  end
end
local window = 0
if ARGV[10] == '1' then
  window = hit(KEYS[6], KEYS[7], tonumber(ARGV[6]), tonumber(ARGV[7]), tokens,
               tonumber(ARGV[8]), tonumber(ARGV[9]), id .. ':' .. tokens)
  if window[1] == 0 then
    return {0, window, -1, 0, 0, 0}
  end
end
if limit < 0 and more == 0 then
  return {0, window, -1, 0, 0, 0}
end
if limit >= 0 then
  use(1)
  if not fits(limit, tokens) then
    return {0, window, -1, used(), reserved(), 0}
  end
end
for j = 1, more do
  use(4 + 4 * j)
  if not fits(tonumber(ARGV[10 + 2 * j]), tonumber(ARGV[11 + 2 * j])) then
    return {0, window, -1, used(), reserved(), j}
  end
end
local expires_at = now + ttl_ms
if limit >= 0 then
  use(1)
  hold(tokens, expires_at, id)
end
for j = 1, more do
  use(4 + 4 * j)
  hold(tonumber(ARGV[11 + 2 * j]), expires_at, id)
end
return {0, window, expires_at, 0, 0, 0}
"""
)


class RedisAdmissionStore:
    """``AdmissionStore`` in Redis; the caller owns (and closes) the client."""

    def __init__(self, client: RedisCommands, window_s: float = DEFAULT_WINDOW_S) -> None:
        check_window(window_s)
        self._window_s = window_s
        self._window_ms = max(1, round(window_s * 1000))
        self._admit = client.register_script(_ADMIT)
        self._id_prefix = secrets.token_hex(8)
        self._ids = itertools.count()
        self._keys: dict[tuple[str, str], list[str]] = {}  # the script's keys, built once
        self._more_keys: dict[tuple[str, str, BudgetAccount], list[str]] = {}

    def _keys_of(self, tenant_id: str, period_key: str) -> list[str]:
        keys = self._keys.get((tenant_id, period_key))
        if keys is None:
            if len(self._keys) >= _MAX_CACHED_KEYS:
                self._keys.clear()
            keys = [*BudgetKeys.of(tenant_id, period_key).as_list(), auth_epoch_key(tenant_id)]
            keys += rate_limit_keys(tenant_id)
            self._keys[tenant_id, period_key] = keys
        return keys

    def _balance_keys(self, tenant_id: str, period_key: str, account: BudgetAccount) -> list[str]:
        """The four keys of a balance beside the tenant's tokens, built once."""
        cached = self._more_keys.get((tenant_id, period_key, account))
        if cached is None:
            if len(self._more_keys) >= _MAX_CACHED_KEYS:
                self._more_keys.clear()
            cached = BudgetKeys.of(tenant_id, period_key, account).as_list()
            self._more_keys[tenant_id, period_key, account] = cached
        return cached

    async def admit(self, ask: AdmissionAsk) -> AdmissionResult:
        check_hit_args(ask.tokens, ask.rpm_limit, ask.tpm_limit)
        budget, more = ask.budget, ask.more_budgets
        if budget is not None:
            check_reserve_args(budget.limit, ask.tokens, budget.ttl_s)
        if more:
            check_asks(more, ask.ttl_s)
        is_budgeted = budget is not None or bool(more)
        keys = self._keys_of(ask.tenant_id, budget.period_key if budget else _NO_BUDGET_PERIOD)
        reservation_id = f"{self._id_prefix}{next(self._ids):x}"
        args: list[int | str] = [
            ask.auth_epoch,
            -1 if budget is None else budget.limit,
            ask.tokens,
            max(1, round(ask.ttl_s * 1000)) if is_budgeted else 0,
            reservation_id,
            round(ask.now * 1000),
            self._window_ms,
            -1 if ask.rpm_limit is None else ask.rpm_limit,
            -1 if ask.tpm_limit is None else ask.tpm_limit,
            1 if ask.has_rate_limit else 0,
            len(more),
        ]
        if more:
            keys = list(keys)
            for hold in more:
                keys += self._balance_keys(ask.tenant_id, hold.period_key, hold.account)
                args += [hold.limit, hold.amount]
        try:
            reply: list[Any] = await self._admit(keys, args)
        except RedisTimeoutError as exc:  # the script may run yet: name what it would reserve
            maybe = None
            if is_budgeted:
                expires_at = ask.now + ask.ttl_s  # the server's clock decides; near enough
                maybe = _reservation(ask, reservation_id, expires_at)
            raise AdmissionTimedOut(str(exc), maybe) from None
        if reply[0] == 1:
            epoch = reply[1]
            return AuthChanged(epoch.decode() if isinstance(epoch, bytes) else str(epoch))
        if reply[0] == 2:
            return BalanceUnknown(int(reply[1]))
        _, window_reply, expires_ms, used, reserved, refused_by = reply
        window = window_state(window_reply, self._window_s) if ask.has_rate_limit else None
        if not is_budgeted or (window is not None and not window.is_admitted):
            return Counted(window)
        if int(expires_ms) < 0:
            balance = Balance(used=int(used), reserved=int(reserved))
            return Counted(window, balance=balance, refused_by=int(refused_by))
        return Counted(window, _reservation(ask, reservation_id, int(expires_ms) / 1000))


def _reservation(ask: AdmissionAsk, reservation_id: str, expires_at: float) -> Reservation:
    """What the script holds for ``ask``: the tenant's token budget first where asked."""
    if ask.budget is not None and not ask.more_budgets:  # the common case: one balance
        return Reservation(
            reservation_id, ask.tenant_id, ask.budget.period_key, ask.tokens, expires_at
        )
    holds = [Hold(h.account, h.period_key, h.amount) for h in ask.more_budgets]
    if ask.budget is not None:
        holds.insert(0, Hold(TENANT_TOKENS, ask.budget.period_key, ask.tokens))
    first = holds[0]
    return Reservation(
        reservation_id,
        ask.tenant_id,
        first.period_key,
        first.amount,
        expires_at,
        first.account,
        tuple(holds[1:]),
    )
