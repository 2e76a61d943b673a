"""One tenant's sliding window in Redis: its keys, the Lua ``hit`` that checks and records a
request in it, and ``hit``'s reply read back as a `WindowState` (see ``rate_limit_store``).

``hit`` runs inside the admission script (`gateway.admission.redis_admission_store`), after
the auth-epoch check and before the budget reservation, so every gateway replica counts in
the same window. Per tenant (hash tag: one cluster slot)::

    tollway:ratelimit:{acme}:hits    ZSET    "<id>:<tokens>" -> ts (ms)
    tollway:ratelimit:{acme}:tokens  STRING  sum of the tokens in the ZSET

Times come from the caller's ``now`` (rounded to milliseconds), not Redis ``TIME``: the
policy computes Retry-After and the headers against the same ``now``, and a few
milliseconds of skew between NTP-synced replicas only shifts a window edge by as much.
Both keys expire one window after the newest hit, so idle tenants cost nothing.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from gateway.ratelimit.rate_limit_store import WindowState

# hit(hits_key, tokens_key, now_ms, window_ms, tokens, rpm_limit, tpm_limit (-1: none), member)
# returns {admitted, num_requests, num_tokens, oldest, newest, requests_fit, tokens_fit}
# (times in ms; false -> nil for "none"). The checks are policies.rate_limit.within_limit's;
# tests/policies/rate_limit_cases.py runs one table of cases against it (through the
# admission script), the in-process store and the policy.
HIT_FUNCTION = """
local function hit(hits, tokens_key, now, window, tokens, rpm, tpm, member)
  local cutoff = now - window
  local total = tonumber(redis.call('GET', tokens_key) or '0')
  for _, expired in ipairs(redis.call('ZRANGEBYSCORE', hits, '-inf', cutoff)) do
    total = total - tonumber(string.match(expired, ':(%d+)$'))
  end
  redis.call('ZREMRANGEBYSCORE', hits, '-inf', cutoff)
  local count = redis.call('ZCARD', hits)
  if count == 0 then
    total = 0
  end
  local requests_ok = rpm < 0 or count + 1 <= rpm
  local tokens_ok = tpm < 0 or total + tokens <= tpm
  local admitted = 0
  if requests_ok and tokens_ok then
    redis.call('ZADD', hits, now, member)
    count = count + 1
    total = total + tokens
    admitted = 1
  end
  local requests_fit, tokens_fit = now, now
  if not requests_ok then
    requests_fit = false
    if rpm > 0 then
      local kth = redis.call('ZRANGE', hits, count - rpm, count - rpm, 'WITHSCORES')
      requests_fit = tonumber(kth[2]) + window
    end
  end
  if not tokens_ok then
    tokens_fit = false
    local to_free, freed = total + tokens - tpm, 0
    local log = redis.call('ZRANGE', hits, 0, -1, 'WITHSCORES')
    for i = 1, #log, 2 do
      freed = freed + tonumber(string.match(log[i], ':(%d+)$'))
      if freed >= to_free then
        tokens_fit = tonumber(log[i + 1]) + window
        break
      end
    end
  end
  local oldest, newest = false, false
  if count > 0 then
    oldest = tonumber(redis.call('ZRANGE', hits, 0, 0, 'WITHSCORES')[2])
    newest = tonumber(redis.call('ZRANGE', hits, -1, -1, 'WITHSCORES')[2])
    local ttl = math.max(1, newest + window - now)
    redis.call('SET', tokens_key, total, 'PX', ttl)
    redis.call('PEXPIRE', hits, ttl)
  else
    redis.call('DEL', tokens_key)
  end
  return {admitted, count, total, oldest, newest, requests_fit, tokens_fit}
end
"""


def rate_limit_keys(tenant_id: str) -> tuple[str, str]:
    """``(hits, tokens)``: the keys of one tenant's window."""
    prefix = f"tollway:ratelimit:{{{quote(tenant_id, safe='')}}}"
    return f"{prefix}:hits", f"{prefix}:tokens"


def window_state(reply: list[Any], window_s: float) -> WindowState:
    """The ``WindowState`` of one ``hit`` reply."""
    admitted, num_requests, num_tokens, oldest, newest, requests_fit, tokens_fit = reply
    return WindowState(
        is_admitted=admitted == 1,
        window_s=window_s,
        num_requests=int(num_requests),
        num_tokens=int(num_tokens),
        oldest_at=_seconds(oldest),
        newest_at=_seconds(newest),
        requests_fit_at=_seconds(requests_fit),
        tokens_fit_at=_seconds(tokens_fit),
    )


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else int(ms) / 1000
