"""What a real redis-server is doing, seen from outside, for tests that must wait for it
(a call that reached it, a server that has stopped answering) instead of sleeping."""

from __future__ import annotations

import redis

from tests.support.polling import eventually

ASLEEP_PROBE_S = 0.05  # a server that does not answer a PING this fast is taken as asleep


async def until_blocked_in(redis_url: str, command: str) -> None:
    """Wait until some client of the server is blocked in ``command`` (its call was sent)."""

    def is_blocked() -> bool:
        with redis.Redis.from_url(redis_url) as admin:
            return any(c["cmd"] == command for c in admin.client_list(_type="normal"))

    await eventually(is_blocked, what=f"a client is blocked in {command}")


async def until_asleep(redis_url: str) -> None:
    """Wait until the server has stopped answering (a ``DEBUG SLEEP`` has begun)."""

    def is_asleep() -> bool:
        with redis.Redis.from_url(redis_url, socket_timeout=ASLEEP_PROBE_S) as probe:
            try:
                probe.ping()
            except redis.TimeoutError:
                return True
        return False

    await eventually(is_asleep, what="the server is asleep")
