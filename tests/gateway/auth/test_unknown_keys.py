"""Unknown bearer keys cost no database read: the shape check and the remembered refusals of
the key cache, over a real migrated SQLite database, with auth epochs in process and in Redis.
Reads are counted as the statements that touch ``api_keys``."""

from __future__ import annotations

import asyncio
import random
import secrets
import string
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy import event
from starlette.applications import Starlette

from gateway.api.admin_api import admin_routes
from gateway.auth.epochs import AuthEpochs, MemoryAuthEpochs, RedisAuthEpochs
from gateway.auth.key_cache import KeyCache
from gateway.errors import EXCEPTION_HANDLERS, ApiError
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import generate_key, hash_key
from gateway.storage.database import Database
from gateway.storage.models import ApiKeyRow, utc_now
from gateway.storage.tenants import create_tenant, get_tenant

ADMIN_KEY = "admin-" + "x" * 40


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


@contextmanager
def counted_reads(db: Database) -> Iterator[list[str]]:
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if "api_keys" in statement:
            statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(db.engine, "before_cursor_execute", count)


def store_key(db: Database, token: str, tenant_id: str = "acme") -> None:
    """Commit a key row for a token chosen in advance (``create_key`` draws its own), as the
    admin API's transaction does; announcing it is left to the caller."""
    with db.transaction() as session:
        if get_tenant(session, tenant_id) is None:
            create_tenant(session, tenant_id, name=tenant_id, tier="standard", quota={})
        session.add(
            ApiKeyRow(
                id="key_" + secrets.token_hex(12),
                tenant_id=tenant_id,
                prefix=token[:12],
                key_hash=hash_key(token),
                name="",
                priority=None,
                created_at=utc_now(),
                revoked_at=None,
                expires_at=None,
            )
        )


async def refused(cache: KeyCache, token: str) -> bool:
    with pytest.raises(ApiError) as raised:
        await cache.key(token)
    rejection = raised.value.rejection
    return (rejection.status, rejection.code) == (401, "invalid_api_key")


async def test_malformed_tokens_are_refused_without_a_read(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60, unknown_ttl_s=60)
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
    assert cache.num_unknown == 0


async def test_one_junk_key_sent_500_times_reads_the_database_once(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60, unknown_ttl_s=60)
    junk = generate_key()
    with counted_reads(db) as reads:
        together = await asyncio.gather(
            *(cache.key(junk) for _ in range(250)), return_exceptions=True
        )
        assert all(isinstance(r, ApiError) and r.rejection.status == 401 for r in together)
        for _ in range(250):
            assert await refused(cache, junk)
    assert len(reads) == 1
    assert cache.num_unknown == 1
    assert len(cache) == 0  # never among the known keys


async def test_1000_requests_with_random_well_shaped_junk_keys_read_a_handful_of_times(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    """A flood of requests drawn at random from a few made-up keys: one read per key.
    (Each *distinct* made-up key costs one read the first time: its hash is all the cache can
    remember about it.)"""
    cache = KeyCache(db, new_epochs(), ttl_s=60, unknown_ttl_s=60)
    junk = [generate_key() for _ in range(5)]
    rng = random.Random(5)
    with counted_reads(db) as reads:
        for _ in range(1000):
            assert await refused(cache, rng.choice(junk))
    assert len(reads) == len(junk)


async def test_a_key_created_after_it_was_refused_works_at_once_on_every_gateway(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    first_epochs, second_epochs = new_epochs(), new_epochs()
    first = KeyCache(db, first_epochs, ttl_s=60, unknown_ttl_s=3600)
    second = KeyCache(db, second_epochs, ttl_s=60, unknown_ttl_s=3600)
    token = generate_key()
    assert await refused(first, token)
    assert await refused(second, token)
    store_key(db, token)
    await first_epochs.bump("acme")  # what the first gateway's admin API does after the commit
    assert (await first.key(token)).caller.tenant_id == "acme"
    assert (await second.key(token)).caller.tenant_id == "acme"
    assert first.num_unknown == second.num_unknown == 0


async def test_a_key_written_straight_into_the_database_waits_out_the_unknown_ttl(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    clock = Clock()
    cache = KeyCache(db, new_epochs(), ttl_s=60, unknown_ttl_s=5, clock=clock)
    token = generate_key()
    assert await refused(cache, token)
    store_key(db, token)  # no admin API: no epoch bump
    clock.now += 4.9
    assert await refused(cache, token)
    clock.now += 0.1
    assert (await cache.key(token)).caller.tenant_id == "acme"


async def test_creating_a_key_through_the_admin_api_reaches_the_other_gateways(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    """The admin API's create announces the new key: a key refused before on another gateway
    (here one committed in the same moment) works there on the next request."""
    first_epochs, second_epochs = new_epochs(), new_epochs()
    second = KeyCache(db, second_epochs, ttl_s=60, unknown_ttl_s=3600)
    routes = admin_routes(db, hash_key(ADMIN_KEY), MemoryBudgetLedger(), auth_epochs=first_epochs)
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        assert (
            await c.post("/admin/tenants", json={"id": "acme", "name": "Acme"})
        ).status_code == 201
        token = generate_key()
        assert await refused(second, token)
        store_key(db, token)
        created = await c.post("/admin/tenants/acme/keys", json={})
        assert created.status_code == 201
    assert (await second.key(token)).caller.tenant_id == "acme"
    assert (await second.key(created.json()["key"])).caller.tenant_id == "acme"


async def test_the_remembered_refusals_are_bounded_least_recent_out_first(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60, unknown_ttl_s=60, max_unknown=3)
    junk = [generate_key() for _ in range(4)]
    with counted_reads(db) as reads:
        for token in junk[:3]:
            assert await refused(cache, token)
        assert await refused(cache, junk[0])  # remembered: now the most recent
        assert len(reads) == 3
        assert await refused(cache, junk[3])  # makes room: junk[1] goes
        assert cache.num_unknown == 3
        assert len(reads) == 4
        for token in (junk[0], junk[2], junk[3]):
            assert await refused(cache, token)
        assert len(reads) == 4
        assert await refused(cache, junk[1])
        assert len(reads) == 5
    for _ in range(100):
        assert await refused(cache, generate_key())
    assert cache.num_unknown == 3


class FailingEpochs(MemoryAuthEpochs):
    async def key_set(self) -> str:
        raise RedisConnectionError("down")


async def test_an_epoch_store_that_cannot_answer_leaves_refusals_to_the_database(
    db: Database,
) -> None:
    cache = KeyCache(db, FailingEpochs(), ttl_s=60, unknown_ttl_s=60)
    junk = generate_key()
    with counted_reads(db) as reads:
        assert await refused(cache, junk)
        assert await refused(cache, junk)
    assert len(reads) == 2
    assert cache.num_unknown == 0


async def test_a_zero_unknown_ttl_reads_every_unknown_key(db: Database) -> None:
    cache = KeyCache(db, MemoryAuthEpochs(), ttl_s=60, unknown_ttl_s=0)
    junk = generate_key()
    with counted_reads(db) as reads:
        assert await refused(cache, junk)
        assert await refused(cache, junk)
    assert len(reads) == 2
    with pytest.raises(ValueError, match="unknown_ttl_s"):
        KeyCache(db, MemoryAuthEpochs(), ttl_s=60, unknown_ttl_s=-1)
    with pytest.raises(ValueError, match="max_unknown"):
        KeyCache(db, MemoryAuthEpochs(), ttl_s=60, max_unknown=0)
