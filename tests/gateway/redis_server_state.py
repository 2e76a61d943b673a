"""What a real redis-server is doing, seen from outside, for tests that must wait for it (a
call that reached it) instead of sleeping. To stall it, pause it (`RedisServer.paused`)."""

from __future__ import annotations

import redis

from tests.support.polling import eventually


async def until_blocked_in(redis_url: str, command: str) -> None:
    """Wait until some client of the server is blocked in ``command`` (its call was sent)."""

    def is_blocked() -> bool:
        with redis.Redis.from_url(redis_url) as admin:
            return any(c["cmd"] == command for c in admin.client_list(_type="normal"))

    await eventually(is_blocked, what=f"a client is blocked in {command}")
