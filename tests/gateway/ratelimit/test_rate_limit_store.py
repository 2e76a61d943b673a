"""One suite, run against both stores: in-process, and Redis on a real redis-server.

The rule itself (within, at and over the limits, the window rolling, limits that can never be
met) is the table of cases in ``tests/policies/rate_limit_cases.py``, which also runs against
the policy; the other tests here check what it cannot: several gateways on one store,
concurrency, tenants, and bad arguments."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.ratelimit.rate_limit_store import RateLimitStore, WindowState
from gateway.ratelimit.redis_store import RedisRateLimitStore
from tests.policies.rate_limit_cases import (
    T0,
    TENANT,
    WINDOW_S,
    RateLimitCase,
    case_id,
    cases_for,
    check_hit,
)


@pytest.fixture(params=["memory", "redis"])
async def new_store(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], RateLimitStore]]:
    """``new_store()`` is one more gateway on the same counts (memory: there is only one)."""
    if request.param == "memory":
        store = MemoryRateLimitStore(window_s=WINDOW_S)
        yield lambda: store
        return
    url: str = request.getfixturevalue("redis_url")
    clients: list[Redis] = []

    def new_redis_store() -> RateLimitStore:
        clients.append(Redis.from_url(url))
        return RedisRateLimitStore(clients[-1], window_s=WINDOW_S)

    yield new_redis_store
    for client in clients:
        await client.aclose()


@pytest.fixture
def store(new_store: Callable[[], RateLimitStore]) -> RateLimitStore:
    return new_store()


@pytest.mark.parametrize(
    ("new_store", "case"),
    [
        pytest.param(kind, case, id=f"{kind}-{case_id(case)}")
        for kind in ("memory", "redis")
        for case in cases_for(kind)
    ],
    indirect=["new_store"],
)
async def test_rate_limit_cases(store: RateLimitStore, case: RateLimitCase) -> None:
    for hit in case.hits:
        rpm, tpm = case.limits_of(hit)
        check_hit(case, hit, await store.hit(TENANT, hit.tokens, rpm, tpm, now=T0 + hit.at))


async def test_requests_slide_out_of_the_window(store: RateLimitStore) -> None:
    first = await store.hit(TENANT, 5, rpm_limit=2, tpm_limit=None, now=T0)
    assert first == WindowState(
        is_admitted=True,
        window_s=60.0,
        num_requests=1,
        num_tokens=5,
        oldest_at=T0,
        newest_at=T0,
        requests_fit_at=T0,
        tokens_fit_at=T0,
    )
    assert (await store.hit(TENANT, 5, 2, None, now=T0 + 10)).is_admitted
    refused = await store.hit(TENANT, 5, 2, None, now=T0 + 20)
    assert refused == WindowState(
        is_admitted=False,
        window_s=60.0,
        num_requests=2,
        num_tokens=10,
        oldest_at=T0,
        newest_at=T0 + 10,
        requests_fit_at=T0 + 60,
        tokens_fit_at=T0 + 20,
    )
    assert not (await store.hit(TENANT, 5, 2, None, now=T0 + 59.999)).is_admitted
    at_expiry = await store.hit(TENANT, 5, 2, None, now=T0 + 60)  # the first hit just left
    assert at_expiry.is_admitted
    assert (at_expiry.num_requests, at_expiry.oldest_at, at_expiry.newest_at) == (
        2,
        T0 + 10,
        T0 + 60,
    )


async def test_tenants_have_separate_windows(store: RateLimitStore) -> None:
    assert (await store.hit("a", 10, rpm_limit=1, tpm_limit=10, now=T0)).is_admitted
    assert not (await store.hit("a", 1, rpm_limit=None, tpm_limit=10, now=T0)).is_admitted
    other = await store.hit("b", 10, rpm_limit=1, tpm_limit=10, now=T0)
    assert other.is_admitted and other.num_tokens == 10


async def test_hit_rejects_bad_arguments(store: RateLimitStore) -> None:
    for tokens, rpm, tpm in [(-1, None, None), (1, -1, None), (1, None, -1)]:
        with pytest.raises(ValueError):
            await store.hit(TENANT, tokens, rpm, tpm, now=T0)


async def test_concurrent_hits_through_two_gateways(
    new_store: Callable[[], RateLimitStore],
) -> None:
    gateways = [new_store(), new_store()]
    by_requests = await asyncio.gather(
        *(gateways[i % 2].hit("r", 7, rpm_limit=50, tpm_limit=None, now=T0) for i in range(200))
    )
    assert sum(state.is_admitted for state in by_requests) == 50
    by_tokens = await asyncio.gather(
        *(gateways[i % 2].hit("t", 10, rpm_limit=None, tpm_limit=1000, now=T0) for i in range(200))
    )
    assert sum(state.is_admitted for state in by_tokens) == 100
    final_r = await gateways[0].hit("r", 7, rpm_limit=50, tpm_limit=None, now=T0 + 1)
    final_t = await gateways[1].hit("t", 1, rpm_limit=None, tpm_limit=1000, now=T0 + 1)
    assert (final_r.is_admitted, final_r.num_requests, final_r.num_tokens) == (False, 50, 350)
    assert (final_t.is_admitted, final_t.num_requests, final_t.num_tokens) == (False, 100, 1000)
