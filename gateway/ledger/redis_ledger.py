"""Redis budget ledger: one balance shared by any number of gateway replicas.

Each operation is one Lua script, so it is atomic on the server. Every key of a tenant shares
the hash tag ``{tenant}`` (one cluster slot), so the admission script
(``admission.redis_atomic_step``) can check rate limits and reserve budget in one call; tenant and
period are percent-encoded so ``("a:b", "c")`` and ``("a", "b:c")`` cannot collide::

    tollway:budget:{acme}:day%3A2025-06-01                    HASH  used, known, reserved
    tollway:budget:{acme}:day%3A2025-06-01:reservations       ZSET  id -> expires_at (ms)
    tollway:budget:{acme}:day%3A2025-06-01:reservation_tokens HASH  id -> tokens
    tollway:budget:{acme}:day%3A2025-06-01:lapsed             ZSET  id -> expired_at (ms)

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
from dataclasses import dataclass
from urllib.parse import quote

from gateway.ledger.budget_ledger import (
    DEFAULT_SETTLED_RETENTION_S,
    Balance,
    Reservation,
    check_reserve_args,
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
-- Holds `tokens` until now + ttl_ms if they fit under `limit` (the rule of
-- policies.budget_admission.fits_budget; tests/policies/budget_cases.py keeps them one):
-- expires_at (ms), else false.
local function reserve(limit, tokens, ttl_ms, id)
  local total = reserved()
  if used() + total + tokens > limit then
    return false
  end
  local expires_at = now + ttl_ms
  redis.call('ZADD', reservations, expires_at, id)
  redis.call('HSET', reservation_tokens, id, tokens)
  redis.call('HSET', account, 'reserved', total + tokens)
  return expires_at
end
"""
_PRELUDE = LEDGER_FUNCTIONS + "purge()\n"

# ARGV: limit, tokens, ttl_ms, id. Returns expires_at (ms), or nil to refuse.
_RESERVE = (
    _PRELUDE
    + """
return reserve(tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4])
"""
)

# ARGV: id, retention (ms), used_tokens.
_SETTLE = (
    _PRELUDE
    + """
local used_tokens = tonumber(ARGV[3])
if finish(ARGV[1], tonumber(ARGV[2])) and used_tokens > 0 then
  redis.call('HINCRBY', account, 'used', used_tokens)
end
return 0
"""
)

# ARGV: id, retention (ms).
_RELEASE = (
    _PRELUDE
    + """
finish(ARGV[1], tonumber(ARGV[2]))
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
    def of(cls, tenant_id: str, period_key: str) -> BudgetKeys:
        account = f"tollway:budget:{{{quote(tenant_id, safe='')}}}:{quote(period_key, safe='')}"
        return cls(
            account,
            f"{account}:reservations",
            f"{account}:reservation_tokens",
            f"{account}:lapsed",
        )

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
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._release = client.register_script(_RELEASE)
        self._balance = client.register_script(_BALANCE)
        self._rebuild = client.register_script(_REBUILD)
        self._settle_keys: dict[tuple[str, str], list[str]] = {}

    async def reserve(
        self, tenant_id: str, period_key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        check_reserve_args(limit, tokens, ttl_s)
        reservation_id = uuid.uuid4().hex
        keys = BudgetKeys.of(tenant_id, period_key).as_list()
        ttl_ms = max(1, _to_ms(ttl_s))
        expires_ms = await self._reserve(keys, [limit, tokens, ttl_ms, reservation_id])
        if expires_ms is None:
            return None
        return Reservation(reservation_id, tenant_id, period_key, tokens, int(expires_ms) / 1000)

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        check_used_tokens(used_tokens)
        keys = self._keys_of(reservation)
        await self._settle(keys, [*self._finish_args(reservation), used_tokens])

    async def release(self, reservation: Reservation) -> None:
        await self._release(self._keys_of(reservation), self._finish_args(reservation))

    async def balance(self, tenant_id: str, period_key: str) -> Balance:
        used, reserved = await self._balance(BudgetKeys.of(tenant_id, period_key).as_list())
        return Balance(used=int(used), reserved=int(reserved))

    async def rebuild(self, tenant_id: str, period_key: str, used_tokens: int) -> bool:
        check_used_tokens(used_tokens)
        keys = BudgetKeys.of(tenant_id, period_key).as_list()
        return int(await self._rebuild(keys, [used_tokens])) == 1

    async def is_known(self, tenant_id: str, period_key: str) -> bool:
        account = BudgetKeys.of(tenant_id, period_key).account
        return bool(await self._client.execute_command("HEXISTS", account, "known"))

    def _keys_of(self, reservation: Reservation) -> list[str]:
        """The balance's keys, built once per (tenant, period) this gateway settles."""
        key = (reservation.tenant_id, reservation.period_key)
        keys = self._settle_keys.get(key)
        if keys is None:
            if len(self._settle_keys) >= _MAX_CACHED_KEYS:
                self._settle_keys.clear()
            keys = self._settle_keys[key] = BudgetKeys.of(*key).as_list()
        return keys

    def _finish_args(self, reservation: Reservation) -> list[int | str]:
        return [reservation.reservation_id, self._retention_ms]


def _to_ms(seconds: float) -> int:
    return round(seconds * 1000)
