"""Let time pass for the Redis budget ledger without waiting for it.

The ledger's Lua reads the server's clock (``TIME``), which no client can set, and that is
as it must stay: replicas whose clocks differ agree on expiry only because the server keeps
time. But every instant the scripts keep is a score in a budget's two sorted sets
(``reservations``: expiry, ``lapsed``: when it expired), and the scripts only ever compare
those with ``now`` (``now + ttl``, ``now - retention``). Moving every kept instant back by
``s`` is therefore, to the scripts, ``s`` seconds passing: `let_ledger_time_pass` does that, in
one script, for every budget in the database. Real time still passes too, so a test keeps
its TTLs and retentions long (a minute, not 50 ms): what a few busy milliseconds add then
changes no outcome.
"""

from __future__ import annotations

from gateway.storage.redis_client import RedisCommands

_SHIFT = """
local ms = tonumber(ARGV[1])
for _, pattern in ipairs({'tollway:budget:*:reservations', 'tollway:budget:*:lapsed'}) do
  for _, key in ipairs(redis.call('KEYS', pattern)) do
    local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
      redis.call('ZADD', key, tonumber(entries[i + 1]) - ms, entries[i])
    end
  end
end
return 0
"""


async def let_ledger_time_pass(client: RedisCommands, seconds: float) -> None:
    """To the Redis ledger's scripts, ``seconds`` pass now (see the module's docstring)."""
    await client.execute_command("EVAL", _SHIFT, 0, round(seconds * 1000))
