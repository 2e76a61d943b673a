"""One suite, run against both stores: in-process, and Redis on a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.ratelimit.rate_limit_store import RateLimitStore, WindowState
from gateway.ratelimit.redis_store import RedisRateLimitStore

TENANT = "acme"
T0 = 1_750_000_000.0


@pytest.fixture(params=["memory", "redis"])
async def new_store(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], RateLimitStore]]:
    """``new_store()`` is one more gateway on the same counts (memory: there is only one)."""
    if request.param == "memory":
        store = MemoryRateLimitStore()
        yield lambda: store
        return
    url: str = request.getfixturevalue("redis_url")
    clients: list[Redis] = []

    def new_redis_store() -> RateLimitStore:
        clients.append(Redis.from_url(url))
        return RedisRateLimitStore(clients[-1])

    yield new_redis_store
    for client in clients:
        await client.aclose()


@pytest.fixture
def store(new_store: Callable[[], RateLimitStore]) -> RateLimitStore:
    return new_store()


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


async def test_requests_fit_at_waits_for_enough_hits_to_expire(store: RateLimitStore) -> None:
    for offset in (0, 5, 10, 15):
        assert (await store.hit(TENANT, 1, 4, None, now=T0 + offset)).is_admitted
    refused = await store.hit(TENANT, 1, rpm_limit=2, tpm_limit=None, now=T0 + 20)
    assert not refused.is_admitted
    assert refused.requests_fit_at == T0 + 10 + 60  # three of the four must leave first


async def test_refused_requests_are_not_counted(store: RateLimitStore) -> None:
    assert (await store.hit(TENANT, 1, rpm_limit=1, tpm_limit=None, now=T0)).is_admitted
    for second in range(1, 60):
        state = await store.hit(TENANT, 1, rpm_limit=1, tpm_limit=None, now=T0 + second)
        assert not state.is_admitted
        assert (state.num_requests, state.num_tokens) == (1, 1)
    assert (await store.hit(TENANT, 1, rpm_limit=1, tpm_limit=None, now=T0 + 60)).is_admitted


async def test_token_limit(store: RateLimitStore) -> None:
    for offset in (0, 10, 20):
        assert (
            await store.hit(TENANT, 30, rpm_limit=None, tpm_limit=100, now=T0 + offset)
        ).is_admitted
    refused = await store.hit(TENANT, 50, rpm_limit=None, tpm_limit=100, now=T0 + 30)
    assert not refused.is_admitted
    assert (refused.num_requests, refused.num_tokens) == (3, 90)
    assert refused.requests_fit_at == T0 + 30
    assert refused.tokens_fit_at == T0 + 10 + 60  # 40 tokens must leave: the first two hits
    exact_fit = await store.hit(TENANT, 10, rpm_limit=None, tpm_limit=100, now=T0 + 30)
    assert exact_fit.is_admitted and exact_fit.num_tokens == 100
    later = await store.hit(TENANT, 50, rpm_limit=None, tpm_limit=100, now=T0 + 70)
    assert later.is_admitted
    assert (later.num_requests, later.num_tokens, later.oldest_at) == (3, 90, T0 + 20)


async def test_limits_that_can_never_fit(store: RateLimitStore) -> None:
    too_large = await store.hit(TENANT, 101, rpm_limit=None, tpm_limit=100, now=T0)
    assert not too_large.is_admitted
    assert too_large.tokens_fit_at is None and too_large.requests_fit_at == T0
    assert (too_large.num_requests, too_large.oldest_at, too_large.newest_at) == (0, None, None)
    no_requests = await store.hit(TENANT, 1, rpm_limit=0, tpm_limit=None, now=T0)
    assert not no_requests.is_admitted and no_requests.requests_fit_at is None


async def test_no_limits_admit_everything(store: RateLimitStore) -> None:
    for i in range(50):
        state = await store.hit(TENANT, 1000, rpm_limit=None, tpm_limit=None, now=T0 + i / 10)
        assert state.is_admitted
    assert (state.num_requests, state.num_tokens) == (50, 50_000)


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
