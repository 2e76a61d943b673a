"""The rate-limit store in Redis on its own (`RedisRateLimitStore`, the Lua ``hit`` outside the
admission script), on the real redis-server, through the gateway's own client.

The rule is the table of cases in ``tests/policies/rate_limit_cases.py``: this store runs the
in-process store's cases (the same interface, and a hit with no limit is counted as there).
The other tests check what the table cannot: stores on separate clients (gateway replicas)
share one window, their keys stay apart from the tenants' and from another prefix's, and
Redis failing is `RateLimitUnavailable`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis

from gateway.ratelimit.rate_limit_store import RateLimitUnavailable
from gateway.ratelimit.redis_store import RedisRateLimitStore
from gateway.ratelimit.redis_window import rate_limit_keys
from gateway.storage.redis_client import LeanRedis
from tests.policies.rate_limit_cases import (
    T0,
    TENANT,
    WINDOW_S,
    RateLimitCase,
    case_id,
    cases_for,
    check_hit,
)

PREFIX = "tollway:test-window"


@pytest.fixture
async def new_store(redis_url: str) -> AsyncIterator[Callable[..., RedisRateLimitStore]]:
    """``new_store(prefix=PREFIX)``: a store on a client of its own, as a replica has."""
    clients: list[LeanRedis] = []

    def new(prefix: str = PREFIX) -> RedisRateLimitStore:
        clients.append(LeanRedis(redis_url))
        return RedisRateLimitStore(clients[-1], prefix, window_s=WINDOW_S)

    yield new
    for client in clients:
        await client.aclose()


@pytest.mark.parametrize("case", cases_for("memory"), ids=case_id)
async def test_rate_limit_cases(
    new_store: Callable[..., RedisRateLimitStore], case: RateLimitCase
) -> None:
    store = new_store()
    for hit in case.hits:
        rpm, tpm = case.limits_of(hit)
        check_hit(case, hit, await store.hit(TENANT, hit.tokens, rpm, tpm, now=T0 + hit.at))


async def test_replicas_share_one_window(new_store: Callable[..., RedisRateLimitStore]) -> None:
    first, second = new_store(), new_store()
    seen = [
        await store.hit("10.0.0.7", 0, rpm_limit=3, tpm_limit=None, now=T0 + i)
        for i, store in enumerate((first, second, first, second))
    ]
    assert [s.is_admitted for s in seen] == [True, True, True, False]
    assert [s.num_requests for s in seen] == [1, 2, 3, 3]
    assert seen[-1].requests_fit_at == T0 + WINDOW_S


async def test_keys_stay_apart_from_tenants_and_other_prefixes(
    new_store: Callable[..., RedisRateLimitStore], redis_url: str
) -> None:
    store, other = new_store(), new_store("tollway:other")
    assert (await store.hit("acme", 0, 1, None, now=T0)).is_admitted
    assert (await other.hit("acme", 0, 1, None, now=T0)).is_admitted
    assert not (await store.hit("acme", 0, 1, None, now=T0 + 1)).is_admitted
    with redis.Redis.from_url(redis_url) as client:
        keys = sorted(k.decode() for k in client.keys("*"))
    assert keys == sorted(
        [
            f"{PREFIX}:{{acme}}:hits",
            f"{PREFIX}:{{acme}}:tokens",
            "tollway:other:{acme}:hits",
            "tollway:other:{acme}:tokens",
        ]
    )
    assert not set(keys) & set(rate_limit_keys("acme"))


async def test_redis_unreachable_is_rate_limit_unavailable(tmp_path: Path) -> None:
    client = LeanRedis(f"unix://{tmp_path}/nothing.sock")
    store = RedisRateLimitStore(client, PREFIX)
    with pytest.raises(RateLimitUnavailable, match="Redis did not count the hit"):
        await store.hit("acme", 0, 1, None, now=T0)
    await client.aclose()
