"""Unknown bearer keys cost no database read: the shape check and the filter of the keys that
exist, through the key cache over a real migrated SQLite database, with auth epochs in process
and in Redis. Reads are counted as the statements that touch ``api_keys``."""

from __future__ import annotations

import asyncio
import random
import string
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.applications import Starlette

from gateway.api.admin_api import admin_routes
from gateway.auth.epochs import AuthEpochs, MemoryAuthEpochs, RedisAuthEpochs
from gateway.auth.key_cache import KeyCache
from gateway.auth.known_key_filter import MAX_UNPROMPTED_REFRESHES
from gateway.errors import EXCEPTION_HANDLERS, ApiError
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import generate_key, hash_key, list_keys, revoke_key
from gateway.storage.database import Database
from tests.gateway.auth.key_rows import counted_reads, database_unreachable, store_keys

ADMIN_KEY = "admin-" + "x" * 40
WINDOW_S = 5.0
# The first load, then the refreshes a miss may make in a window without an epoch change.
HANDFUL = 1 + MAX_UNPROMPTED_REFRESHES


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def new_epochs(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], AuthEpochs]]:
    """``new()``: the epochs one more gateway sees (memory: there is only one gateway)."""
    if request.param == "memory":
        epochs = MemoryAuthEpochs()
        yield lambda: epochs
        return
    url: str = request.getfixturevalue("redis_url")
    clients: list[Redis] = []

    def new_redis_epochs() -> AuthEpochs:
        clients.append(Redis.from_url(url))
        return RedisAuthEpochs(clients[-1])

    yield new_redis_epochs
    for client in clients:
        await client.aclose()


def new_cache(db: Database, epochs: AuthEpochs, clock: Clock | None = None) -> KeyCache:
    return KeyCache(
        db, epochs, ttl_s=60, stale_ttl_s=600, unknown_ttl_s=WINDOW_S, clock=clock or Clock()
    )


async def refused(cache: KeyCache, token: str, code: str = "invalid_api_key") -> bool:
    with pytest.raises(ApiError) as raised:
        await cache.key(token)
    rejection = raised.value.rejection
    return (rejection.status, rejection.code) == (401 if code == "invalid_api_key" else 503, code)


async def use_up_unprompted_refreshes(cache: KeyCache) -> None:
    for _ in range(HANDFUL):
        assert await refused(cache, generate_key())


async def test_malformed_tokens_are_refused_without_a_read(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = new_cache(db, new_epochs())
    key = generate_key()
    malformed = [
        "",
        "tw-nope",
        "sk-" + key[3:],
        key[:-1],
        key + "A",
        "tw-" + "!" * 43,
        "tw-" + "é" * 43,
        key[:20] + " " + key[21:],
        key + "\n",
    ]
    rng = random.Random(27)
    alphabet = string.printable
    malformed += ["".join(rng.choices(alphabet, k=rng.randint(1, 80))) for _ in range(1000)]
    with counted_reads(db) as reads:
        for token in malformed:
            assert await refused(cache, token)
    assert reads == []


async def test_1000_random_well_shaped_keys_read_a_handful_of_times(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    """The issue's probe: each made-up key distinct, one after another and all at once."""
    real = [generate_key() for _ in range(20)]
    store_keys(db, real)
    cache = new_cache(db, new_epochs())
    with counted_reads(db) as reads:
        for _ in range(1000):
            assert await refused(cache, generate_key())
        together = await asyncio.gather(
            *(cache.key(generate_key()) for _ in range(1000)), return_exceptions=True
        )
        assert all(isinstance(r, ApiError) and r.rejection.status == 401 for r in together)
    assert 1 <= len(reads) <= HANDFUL
    assert cache.known_keys is not None
    assert len(cache.known_keys) == len(real)
    assert len(cache) == 0  # a refused key is never an entry
    assert (await cache.key(real[7])).caller.tenant_id == "acme"


async def test_one_junk_key_sent_500_times_reads_a_handful_of_times(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = new_cache(db, new_epochs())
    junk = generate_key()
    with counted_reads(db) as reads:
        together = await asyncio.gather(  # within the test Redis client's 100 connections
            *(cache.key(junk) for _ in range(100)), return_exceptions=True
        )
        assert all(isinstance(r, ApiError) and r.rejection.status == 401 for r in together)
        for _ in range(400):
            assert await refused(cache, junk)
    assert len(reads) <= HANDFUL


async def test_a_key_created_through_the_admin_api_works_at_once_on_every_gateway(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    """Both gateways' filters are loaded and have no refresh left but the epoch's: the admin
    API's create (on the first) announces the key, and the next miss anywhere reads it."""
    first_epochs, second_epochs = new_epochs(), new_epochs()
    first, second = new_cache(db, first_epochs), new_cache(db, second_epochs)
    routes = admin_routes(db, hash_key(ADMIN_KEY), MemoryBudgetLedger(), auth_epochs=first_epochs)
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        created = await c.post("/admin/tenants", json={"id": "acme", "name": "Acme"})
        assert created.status_code == 201
        await use_up_unprompted_refreshes(first)
        await use_up_unprompted_refreshes(second)
        assert await refused(second, generate_key())  # no refresh left: refused unread
        created = await c.post("/admin/tenants/acme/keys", json={})
        assert created.status_code == 201
    token = created.json()["key"]
    if isinstance(second_epochs, MemoryAuthEpochs):  # one gateway: the same cache twice
        second = first
    with counted_reads(db) as reads:
        assert (await second.key(token)).caller.tenant_id == "acme"
        assert (await first.key(token)).caller.tenant_id == "acme"
    refreshes = [statement for statement in reads if "created_at >=" in statement]
    assert len(refreshes) == (1 if second is first else 2)  # one per gateway, for the new rows


async def test_a_key_written_straight_into_the_database_waits_at_most_the_window(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    clock = Clock()
    cache = new_cache(db, new_epochs(), clock)
    early, late = generate_key(), generate_key()
    assert await refused(cache, generate_key())  # the filter is loaded
    store_keys(db, [early])  # no admin API: no epoch bump
    assert (await cache.key(early)).caller.tenant_id == "acme"  # a refresh was left
    await use_up_unprompted_refreshes(cache)
    store_keys(db, [late])
    clock.now += WINDOW_S - 0.1
    assert await refused(cache, late)
    clock.now += 0.1
    assert (await cache.key(late)).caller.tenant_id == "acme"


async def test_a_revoked_key_is_still_read_and_refused(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    token = generate_key()
    store_keys(db, [token])
    with db.transaction() as session:
        revoke_key(session, list_keys(session, "acme")[0].id)
    cache = new_cache(db, new_epochs())
    assert await refused(cache, generate_key())  # the filter is loaded, the revoked key in it
    with counted_reads(db) as reads:
        assert await refused(cache, token)
    assert len(reads) == 1  # the key's own read refused it


async def test_a_refresh_the_database_fails_refuses_no_key_that_may_exist(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cached, uncached = generate_key(), generate_key()
    store_keys(db, [cached, uncached])
    epochs = new_epochs()
    clock = Clock()
    cache = new_cache(db, epochs, clock)
    assert (await cache.key(cached)).caller.tenant_id == "acme"  # the filter is loaded
    await use_up_unprompted_refreshes(cache)
    await epochs.bump("someone-else")  # a key was created: the next miss refreshes
    clock.now += 61  # the cached entry is due to be read again
    with database_unreachable(db):
        assert (await cache.key(cached)).caller.tenant_id == "acme"  # stands in, as before
        assert await refused(cache, uncached, "auth_unavailable")
        assert await refused(cache, generate_key(), "auth_unavailable")  # may exist: not 401
    assert (await cache.key(uncached)).caller.tenant_id == "acme"
    assert await refused(cache, generate_key())  # the database is back: 401 again


class FailingEpochs(MemoryAuthEpochs):
    async def key_set(self) -> str:
        raise RedisConnectionError("down")


async def test_an_epoch_store_that_cannot_answer_bounds_the_reads_by_the_window(
    db: Database,
) -> None:
    clock = Clock()
    cache = new_cache(db, FailingEpochs(), clock)
    with counted_reads(db) as reads:
        for _ in range(1000):
            assert await refused(cache, generate_key())
    assert len(reads) <= HANDFUL
    token = generate_key()
    store_keys(db, [token])  # created through another gateway while Redis is down
    assert await refused(cache, token)
    clock.now += WINDOW_S
    assert (await cache.key(token)).caller.tenant_id == "acme"


async def test_a_zero_window_reads_every_unknown_key(db: Database) -> None:
    cache = KeyCache(db, MemoryAuthEpochs(), ttl_s=60, unknown_ttl_s=0)
    assert cache.known_keys is None
    junk = generate_key()
    with counted_reads(db) as reads:
        assert await refused(cache, junk)
        assert await refused(cache, junk)
    assert len(reads) == 2
    with pytest.raises(ValueError, match="unknown_ttl_s"):
        KeyCache(db, MemoryAuthEpochs(), ttl_s=60, unknown_ttl_s=-1)
