"""Redis budget ledger: one balance shared by any number of gateway replicas.

Each operation is one Lua script, so it is atomic on the server. Every key of a tenant shares
the hash tag ``{tenant}`` (one cluster slot), so the admission script
(``admission.redis_atomic_step``) can check rate limits and reserve budget in one call; tenant and
period are percent-encoded so ``("a:b", "c")`` and ``("a", "b:c")`` cannot collide::

    tollway:budget:{acme}:day%3A2025-06-01                    HASH  used, known, reserved
    tollway:budget:{acme}:day%3A2025-06-01:reservations       ZSET  id -> expires_at (ms)
    tollway:budget:{acme}:day%3A2025-06-01:reservation_tokens HASH  id -> tokens
    tollway:budget:{acme}:day%3A2025-06-01:lapsed             ZSET  id -> expired_at (ms)

A budget below the tenant's token budget (``BudgetAccount``: the tenant's money budget, an
API key's, an end user's) has the same four keys under ``<scope>=<subject>=<unit>:``, e.g.
``tollway:budget:{acme}:user=alice=micros:day%3A2025-06-01``, in the tenant's slot too, so
one script reserves against every budget a request must fit (``reserve_all``: each balance
checked, then each held, all or none) and settles or releases them all.

Time is the server's: scripts read ``TIME``, so replicas whose clocks differ still agree on
when a reservation expires (this needs script effects replication: the default since Redis
5, the only mode since Redis 7). ``Reservation.expires_at`` is therefore Redis time.

Expired reservations are purged lazily, inside every script, before anything is counted;
each moves to ``lapsed``, where a late settle still finds it (once) for the retention period.
A finished reservation leaves nothing behind, so what Redis holds per balance follows the
requests in flight, not the requests served (finished ids used to be kept for an hour past
their expiry: at 400 requests/s, over a million entries).
``reserved`` is the sum of ``reservation_tokens``, kept as a field beside ``used`` so that
admitting a request costs the same with ten or ten thousand requests in flight: every script
that adds or drops an entry of ``reservation_tokens`` changes ``reserved`` by as much, in the
same atomic step. A balance written before the field existed has it summed once, from
``reservation_tokens``, by the first script that needs it. Run Redis with
``maxmemory-policy noeviction``: an evicted key loses budget state. Semantics are those of
``budget_ledger``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

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
    check_used_tokens,
)
from gateway.storage.redis_client import RedisCommands

# KEYS[1..4]: account, reservations, reservation_tokens, lapsed. Defines `now` (ms, server
# time) and the functions below; a script calls purge() before it counts anything.
LEDGER_FUNCTIONS = """
local account, reservations, reservation_tokens, lapsed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
-- The `reserved` field; summed from reservation_tokens (and stored) where a balance
-- predates it. A balance that holds nothing is not written: reading it creates no key.
local function reserved()
  local total = redis.call('HGET', account, 'reserved')
  if total then
    return tonumber(total)
  end
  total = 0
  for _, tokens in ipairs(redis.call('HVALS', reservation_tokens)) do
    total = total + tonumber(tokens)
  end
  if total > 0 then
    redis.call('HSET', account, 'reserved', total)
  end
  return total
end
-- Drops reservations' entries from reservation_tokens and their tokens from `reserved`.
local function unreserve(ids)
  local total = reserved()
  for first = 1, #ids, 1000 do  -- unpack() takes a few thousand values at most
    local part = {unpack(ids, first, math.min(first + 999, #ids))}
    for _, tokens in ipairs(redis.call('HMGET', reservation_tokens, unpack(part))) do
      if tokens then
        total = total - tonumber(tokens)
      end
    end
    redis.call('HDEL', reservation_tokens, unpack(part))
  end
  redis.call('HSET', account, 'reserved', math.max(0, total))
end
-- Expired reservations stop counting and are remembered in `lapsed` (by expiry time).
local function purge()
  local expired = redis.call('ZRANGEBYSCORE', reservations, '-inf', now, 'WITHSCORES')
  if #expired > 0 then
    local ids = {}
    for i = 1, #expired, 2 do
      ids[#ids + 1] = expired[i]
      expired[i], expired[i + 1] = expired[i + 1], expired[i]  -- ZADD wants score, member
    end
    unreserve(ids)
    for first = 1, #expired, 1000 do
      redis.call('ZADD', lapsed, unpack(expired, first, math.min(first + 999, #expired)))
    end
    redis.call('ZREMRANGEBYSCORE', reservations, '-inf', now)
  end
end
local function used()
  return tonumber(redis.call('HGET', account, 'used') or '0')
end
-- Drops the reservation; true if this call finished it (live, or lapsed within `retention`
-- ms), false if it was finished before (settle/release are idempotent) or is unknown.
local function finish(id, retention)
  redis.call('ZREMRANGEBYSCORE', lapsed, '-inf', now - retention)
  if redis.call('ZREM', reservations, id) == 1 then
    unreserve({id})
    return true
  end
  return redis.call('ZREM', lapsed, id) == 1
end
-- Whether `amount` fits under `limit` (the rule of policies.budget_admission.fits_budget;
-- tests/policies/budget_cases.py keeps them one).
local function fits(limit, amount)
  return used() + reserved() + amount <= limit
end
-- Holds `amount` until `expires_at` (ms) under `id`.
local function hold(amount, expires_at, id)
  local total = reserved()  -- before the entry it adds, which it would count
  redis.call('ZADD', reservations, expires_at, id)
  redis.call('HSET', reservation_tokens, id, amount)
  redis.call('HSET', account, 'reserved', total + amount)
end
-- Points the functions above at the balance whose four keys start at KEYS[first]: a script
-- over several balances (a request's tenant, key and end-user budgets) visits each in turn.
local function use(first)
  account, reservations = KEYS[first], KEYS[first + 1]
  reservation_tokens, lapsed = KEYS[first + 2], KEYS[first + 3]
end
"""
_PRELUDE = LEDGER_FUNCTIONS + "purge()\n"

# KEYS: four per balance. ARGV: ttl_ms, id, then limit and amount per balance. Every balance
# is checked before any holds: {expires_at (ms)}, or {-1, i, used, reserved} for the first
# (1-based) that does not fit.
_RESERVE_ALL = (
    LEDGER_FUNCTIONS
    + """
local n = #KEYS / 4
for i = 1, n do
  use(4 * i - 3)
  purge()
  if not fits(tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])) then
    return {-1, i, used(), reserved()}
  end
end
local expires_at = now + tonumber(ARGV[1])
for i = 1, n do
  use(4 * i - 3)
  hold(tonumber(ARGV[2 * i + 2]), expires_at, ARGV[2])
end
return {expires_at}
"""
)

# KEYS: four per balance. ARGV: id, retention (ms), then what each balance is charged.
_SETTLE = (
    LEDGER_FUNCTIONS
    + """
for i = 1, #KEYS / 4 do
  use(4 * i - 3)
  purge()
  local charged = tonumber(ARGV[i + 2])
  if finish(ARGV[1], tonumber(ARGV[2])) and charged > 0 then
    redis.call('HINCRBY', account, 'used', charged)
  end
end
return 0
"""
)

# KEYS: four per balance. ARGV: id, retention (ms).
_RELEASE = (
    LEDGER_FUNCTIONS
    + """
for i = 1, #KEYS / 4 do
  use(4 * i - 3)
  purge()
  finish(ARGV[1], tonumber(ARGV[2]))
end
return 0
"""
)

_BALANCE = (
    _PRELUDE
    + """
return {used(), reserved()}
"""
)

# ARGV: used_tokens. Returns 1 if it rebuilt the balance, 0 if it was already known.
_REBUILD = (
    _PRELUDE
    + """
if redis.call('HEXISTS', account, 'known') == 1 then
  return 0
end
redis.call('HSET', account, 'used', ARGV[1], 'known', 1)
return 1
"""
)


_MAX_CACHED_KEYS = 10_000


@dataclass(frozen=True)
class BudgetKeys:
    """The four keys of one balance, in the order ``LEDGER_FUNCTIONS`` reads them."""

    account: str
    reservations: str
    reservation_tokens: str
    lapsed: str

    @classmethod
    def of(
        cls, tenant_id: str, period_key: str, account: BudgetAccount = TENANT_TOKENS
    ) -> BudgetKeys:
        prefix = f"tollway:budget:{{{quote(tenant_id, safe='')}}}:"
        if account != TENANT_TOKENS:  # '=' is quoted in every part, so nothing collides
            subject = quote(account.subject, safe="")
            prefix += f"{account.scope}={subject}={account.unit}:"
        key = prefix + quote(period_key, safe="")
        return cls(key, f"{key}:reservations", f"{key}:reservation_tokens", f"{key}:lapsed")

    def as_list(self) -> list[str]:
        return [self.account, self.reservations, self.reservation_tokens, self.lapsed]


class RedisBudgetLedger:
    """``BudgetLedger`` in Redis; the caller owns (and closes) the client."""

    def __init__(
        self, client: RedisCommands, settled_retention_s: float = DEFAULT_SETTLED_RETENTION_S
    ) -> None:
        if not settled_retention_s > 0:
            raise ValueError(f"settled_retention_s must be > 0, got {settled_retention_s}")
        self._client = client
        self._retention_ms = _to_ms(settled_retention_s)
        self._reserve_all = client.register_script(_RESERVE_ALL)
        self._settle = client.register_script(_SETTLE)
        self._release = client.register_script(_RELEASE)
        self._balance = client.register_script(_BALANCE)
        self._rebuild = client.register_script(_REBUILD)
        # (tenant, (account, period key, ...)) -> the keys of those balances
        self._settle_keys: dict[tuple[str, tuple[object, ...]], list[str]] = {}

    async def reserve(
        self, tenant_id: str, period_key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        held = await self.reserve_all(
            tenant_id, [HoldAsk(TENANT_TOKENS, period_key, limit, tokens)], ttl_s
        )
        return held if isinstance(held, Reservation) else None

    async def reserve_all(
        self, tenant_id: str, asks: Sequence[HoldAsk], ttl_s: float
    ) -> Reservation | Refused:
        check_asks(asks, ttl_s)
        reservation_id = uuid.uuid4().hex
        keys: list[str] = []
        args: list[int | str] = [max(1, _to_ms(ttl_s)), reservation_id]
        for ask in asks:
            keys += BudgetKeys.of(tenant_id, ask.period_key, ask.account).as_list()
            args += [ask.limit, ask.amount]
        reply = await self._reserve_all(keys, args)
        if int(reply[0]) < 0:
            _, index, used, reserved = reply
            return Refused(int(index) - 1, Balance(used=int(used), reserved=int(reserved)))
        first, more = asks[0], asks[1:]
        return Reservation(
            reservation_id,
            tenant_id,
            first.period_key,
            first.amount,
            int(reply[0]) / 1000,
            first.account,
            tuple(Hold(a.account, a.period_key, a.amount) for a in more),
        )

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micros: int = 0
    ) -> None:
        check_used_tokens(used_tokens)
        check_used_tokens(used_micros)
        if reservation.more:
            charges = [charged(hold, used_tokens, used_micros) for hold in reservation.holds]
        else:  # the common case, kept to one hold's work
            charges = [used_micros if reservation.account.unit == "micros" else used_tokens]
        await self._settle(self._keys_of(reservation), [*self._finish_args(reservation), *charges])

    async def release(self, reservation: Reservation) -> None:
        await self._release(self._keys_of(reservation), self._finish_args(reservation))

    async def balance(
        self, tenant_id: str, period_key: str, account: BudgetAccount = TENANT_TOKENS
    ) -> Balance:
        keys = BudgetKeys.of(tenant_id, period_key, account).as_list()
        used, reserved = await self._balance(keys)
        return Balance(used=int(used), reserved=int(reserved))

    async def rebuild(
        self,
        tenant_id: str,
        period_key: str,
        used_tokens: int,
        account: BudgetAccount = TENANT_TOKENS,
    ) -> bool:
        check_used_tokens(used_tokens)
        keys = BudgetKeys.of(tenant_id, period_key, account).as_list()
        return int(await self._rebuild(keys, [used_tokens])) == 1

    async def is_known(
        self, tenant_id: str, period_key: str, account: BudgetAccount = TENANT_TOKENS
    ) -> bool:
        key = BudgetKeys.of(tenant_id, period_key, account).account
        return bool(await self._client.execute_command("HEXISTS", key, "known"))

    def _keys_of(self, reservation: Reservation) -> list[str]:
        """The keys of the reservation's balances, built once per set of balances."""
        balances: tuple[object, ...] = (reservation.account, reservation.period_key)
        if reservation.more:
            balances += tuple((h.account, h.period_key) for h in reservation.more)
        key = (reservation.tenant_id, balances)
        keys = self._settle_keys.get(key)
        if keys is None:
            if len(self._settle_keys) >= _MAX_CACHED_KEYS:
                self._settle_keys.clear()
            keys = []
            for hold in reservation.holds:
                keys += BudgetKeys.of(
                    reservation.tenant_id, hold.period_key, hold.account
                ).as_list()
            self._settle_keys[key] = keys
        return keys

    def _finish_args(self, reservation: Reservation) -> list[int | str]:
        return [reservation.reservation_id, self._retention_ms]


def _to_ms(seconds: float) -> int:
    return round(seconds * 1000)
