"""Sliding-window counters in Redis, on their own: the Lua ``hit`` of `redis_window` as one
script, for windows that are not a tenant's request budget and so are not counted by the
admission script (the console's sign-in attempts, per client address).

Every gateway replica given the same Redis counts in the same window. Keys carry the store's
``prefix``, apart from the tenants' windows::

    <prefix>:{<subject>}:hits    ZSET    "<id>:<tokens>" -> ts (ms)
    <prefix>:{<subject>}:tokens  STRING  sum of the tokens in the ZSET

Redis failing (unreachable, too slow) raises `RateLimitUnavailable`: the caller decides
whether that refuses or admits.
"""

from __future__ import annotations

import itertools
import secrets
from urllib.parse import quote

from redis.exceptions import RedisError

from gateway.ratelimit.rate_limit_store import (
    DEFAULT_WINDOW_S,
    RateLimitUnavailable,
    WindowState,
    check_hit_args,
    check_window,
)
from gateway.ratelimit.redis_window import HIT_FUNCTION, window_state
from gateway.storage.redis_client import RedisCommands

# KEYS: hits, tokens; ARGV: now_ms, window_ms, tokens, rpm, tpm (-1: none), member
_HIT = (
    HIT_FUNCTION
    + """
return hit(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
           tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6])
"""
)


class RedisRateLimitStore:
    """``RateLimitStore`` in Redis; the caller owns (and closes) the client."""

    def __init__(
        self, client: RedisCommands, prefix: str, window_s: float = DEFAULT_WINDOW_S
    ) -> None:
        check_window(window_s)
        self._prefix = prefix
        self._window_s = window_s
        self._window_ms = max(1, round(window_s * 1000))
        self._hit = client.register_script(_HIT)
        self._id_prefix = secrets.token_hex(8)  # members unique across replicas
        self._ids = itertools.count()

    async def hit(
        self,
        tenant_id: str,
        tokens: int,
        rpm_limit: int | None,
        tpm_limit: int | None,
        now: float,
    ) -> WindowState:
        check_hit_args(tokens, rpm_limit, tpm_limit)
        subject = f"{self._prefix}:{{{quote(tenant_id, safe='')}}}"
        member = f"{self._id_prefix}{next(self._ids):x}:{tokens}"
        args = [
            round(now * 1000),
            self._window_ms,
            tokens,
            -1 if rpm_limit is None else rpm_limit,
            -1 if tpm_limit is None else tpm_limit,
            member,
        ]
        try:
            reply = await self._hit([f"{subject}:hits", f"{subject}:tokens"], args)
        except RedisError as exc:
            raise RateLimitUnavailable(f"Redis did not count the hit: {exc}") from exc
        return window_state(reply, self._window_s)
