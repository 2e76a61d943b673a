"""The key cache over a real migrated SQLite database, with auth epochs in process and in Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from redis.asyncio import Redis
from sqlalchemy import event

from gateway.auth.epochs import INITIAL_EPOCH, AuthEpochs, MemoryAuthEpochs, RedisAuthEpochs
from gateway.auth.key_cache import KeyCache
from gateway.errors import ApiError
from gateway.storage.api_keys import create_key, generate_key, list_keys, revoke_key
from gateway.storage.database import Database
from gateway.storage.tenants import create_tenant, get_tenant, update_tenant


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


def new_key(db: Database, tenant_id: str = "acme", expires_at: datetime | None = None) -> str:
    with db.transaction() as session:
        if get_tenant(session, tenant_id) is None:
            create_tenant(session, tenant_id, name=tenant_id, tier="standard", quota={"rpm": 5})
        return create_key(session, tenant_id, expires_at=expires_at).key


def revoke_all(db: Database, tenant_id: str = "acme") -> None:
    with db.transaction() as session:
        for info in list_keys(session, tenant_id):
            revoke_key(session, info.id)


async def refused(cache: KeyCache, token: str) -> bool:
    with pytest.raises(ApiError) as raised:
        await cache.key(token)
    return raised.value.rejection.status == 401


async def test_a_key_is_read_once_then_served_from_memory(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60)
    token = new_key(db)
    entry = await cache.key(token)
    assert entry.caller.tenant_id == "acme"
    assert entry.caller.quota.rpm == 5
    assert entry.epoch == INITIAL_EPOCH
    revoke_all(db)  # behind the cache's back: no epoch bump
    assert await cache.key(token) is entry
    assert "key_hash" not in repr(entry)
    assert token not in repr(entry)


async def test_unknown_and_revoked_keys_are_refused_and_never_cached_as_keys(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60)
    assert await refused(cache, "tw-nope")
    assert await refused(cache, generate_key())
    assert len(cache) == 0
    token = new_key(db)
    revoke_all(db)
    assert await refused(cache, token)
    assert len(cache) == 0


async def test_a_key_that_expires_is_refused_after_caching(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    expires_at = datetime.now(timezone.utc) + timedelta(hours=1)
    wall = Clock(expires_at.timestamp() - 10)
    cache = KeyCache(db, new_epochs(), ttl_s=3600, wall_clock=wall)
    token = new_key(db, expires_at=expires_at)
    entry = await cache.key(token)
    assert entry.expires_at == expires_at.timestamp()
    wall.now = expires_at.timestamp()
    assert await refused(cache, token)
    assert len(cache) == 0


async def test_an_entry_older_than_the_ttl_is_read_again(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    clock = Clock()
    cache = KeyCache(db, new_epochs(), ttl_s=10, clock=clock)
    token = new_key(db)
    await cache.key(token)
    revoke_all(db)
    clock.now += 9.9
    await cache.key(token)
    clock.now += 0.1
    assert await refused(cache, token)


async def test_a_zero_ttl_reads_the_database_every_time(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=0)
    token = new_key(db)
    await cache.key(token)
    assert len(cache) == 0
    revoke_all(db)
    assert await refused(cache, token)


async def test_reload_after_a_bump_sees_the_change_on_another_replica(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    first_epochs, second_epochs = new_epochs(), new_epochs()
    first, second = KeyCache(db, first_epochs, ttl_s=60), KeyCache(db, second_epochs, ttl_s=60)
    token = new_key(db)
    cached = await second.key(token)
    # An admin on the first replica changes the quota, then bumps the epoch.
    with db.transaction() as session:
        update_tenant(session, "acme", quota={"rpm": 7})
    await first_epochs.bump("acme")
    # The second replica's admission step sees the new epoch and reloads under it.
    epoch = await second_epochs.current("acme")
    assert epoch != cached.epoch
    reloaded = await second.reload(cached, epoch)
    assert (reloaded.caller.quota.rpm, reloaded.epoch) == (7, epoch)
    assert await second.key(token) is reloaded
    # A revocation, the same way: the reload refuses and forgets the key.
    revoke_all(db)
    await first_epochs.bump("acme")
    with pytest.raises(ApiError):
        await second.reload(reloaded, await second_epochs.current("acme"))
    assert len(second) == 0
    assert await refused(second, token)
    assert await refused(first, token)


async def test_a_first_sight_reads_the_epoch_before_the_key_it_caches(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    epochs = new_epochs()
    await epochs.bump("acme")
    cache = KeyCache(db, epochs, ttl_s=60)
    entry = await cache.key(new_key(db))
    assert entry.epoch == await epochs.current("acme")


async def test_the_oldest_entries_make_room(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60, max_entries=2)
    tokens = [new_key(db, tenant_id=f"t{n}") for n in range(3)]
    entries = [await cache.key(token) for token in tokens]
    assert len(cache) == 2
    assert await cache.key(tokens[2]) is entries[2]
    assert await cache.key(tokens[0]) is not entries[0]  # evicted, read again


def test_a_negative_ttl_is_refused(db: Database) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        KeyCache(db, MemoryAuthEpochs(), ttl_s=-1)
    with pytest.raises(ValueError, match="stale_ttl_s"):
        KeyCache(db, MemoryAuthEpochs(), ttl_s=1, stale_ttl_s=-1)


@contextmanager
def database_unreachable(db: Database) -> Iterator[None]:
    """The database file moved away: every read fails with an ``OperationalError`` (SQLite
    opens an empty file in its place) until it is back."""
    path = Path(db.engine.url.database or "")
    away = path.with_suffix(".away")
    db.dispose()
    path.rename(away)
    try:
        yield
    finally:
        db.dispose()
        path.unlink(missing_ok=True)
        away.rename(path)


async def unavailable(cache: KeyCache, token: str) -> bool:
    with pytest.raises(ApiError) as raised:
        await cache.key(token)
    return raised.value.rejection.status == 503


async def test_a_verified_key_outlives_a_database_outage_up_to_the_stale_bound(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    clock = Clock()
    cache = KeyCache(db, new_epochs(), ttl_s=10, stale_ttl_s=60, clock=clock)
    token, other = new_key(db), new_key(db)
    entry = await cache.key(token)
    with database_unreachable(db):
        clock.now += 11  # past the ttl: read again, fails, the entry stands in
        assert (await cache.key(token)).caller == entry.caller
        clock.now += 48.9
        assert (await cache.key(token)).caller == entry.caller
        assert await unavailable(cache, other)  # never verified: 503, not 401
        clock.now += 0.2  # 60.1 s after the database last confirmed it
        assert await unavailable(cache, token)
    assert (await cache.key(token)).caller == entry.caller  # the database confirms it again
    assert len(cache) == 1


async def test_a_key_whose_tenant_changed_gets_no_stale_answer(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    clock = Clock()
    epochs = new_epochs()
    cache = KeyCache(db, epochs, ttl_s=10, stale_ttl_s=600, clock=clock)
    token = new_key(db)
    entry = await cache.key(token)
    revoke_all(db)  # through the admin API: committed, then announced
    await epochs.bump("acme")
    with database_unreachable(db):
        with pytest.raises(ApiError) as raised:  # the admission step saw the new epoch
            await cache.reload(entry, await epochs.current("acme"))
        assert raised.value.rejection.status == 503
        clock.now += 11
        assert await unavailable(cache, token)
    assert await refused(cache, token)


async def test_a_zero_stale_ttl_serves_nothing_from_memory_when_the_database_fails(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    clock = Clock()
    cache = KeyCache(db, new_epochs(), ttl_s=10, stale_ttl_s=0, clock=clock)
    token = new_key(db)
    await cache.key(token)
    with database_unreachable(db):
        clock.now += 11
        assert await unavailable(cache, token)


async def test_a_zero_ttl_still_lets_a_verified_key_stand_in_for_a_failed_database(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    clock = Clock()
    cache = KeyCache(db, new_epochs(), ttl_s=0, stale_ttl_s=60, clock=clock)
    token = new_key(db)
    entry = await cache.key(token)
    revoke_all(db)
    assert await refused(cache, token)  # read every time while the database answers
    token = new_key(db)
    entry = await cache.key(token)
    with database_unreachable(db):
        clock.now += 1
        assert (await cache.key(token)).caller == entry.caller


async def test_concurrent_misses_for_one_key_share_one_database_read(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60)
    token, unknown = new_key(db), generate_key()
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if "api_keys" in statement:
            statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        entries = await asyncio.gather(*(cache.key(token) for _ in range(50)))
        assert all(entry is entries[0] for entry in entries)
        first_sight = len(statements)  # the key, then the key again after its epoch
        assert 1 <= first_sight <= 2
        refusals = await asyncio.gather(
            *(cache.key(unknown) for _ in range(50)), return_exceptions=True
        )
        assert all(isinstance(r, ApiError) and r.rejection.status == 401 for r in refusals)
        assert len(statements) == first_sight + 1
        # Once answered, the next miss reads again (refusals are remembered only with
        # unknown_ttl_s > 0: tests/gateway/auth/test_unknown_keys.py).
        assert await refused(cache, unknown)
        assert len(statements) == first_sight + 2
    finally:
        event.remove(db.engine, "before_cursor_execute", count)


async def test_a_caller_that_leaves_does_not_cancel_the_shared_read(
    db: Database, new_epochs: Callable[[], AuthEpochs]
) -> None:
    cache = KeyCache(db, new_epochs(), ttl_s=60)
    token = new_key(db)
    leaving = asyncio.ensure_future(cache.key(token))
    staying = asyncio.ensure_future(cache.key(token))
    await asyncio.sleep(0)  # both are waiting on the one read
    leaving.cancel()
    entry = await staying
    assert entry.caller.tenant_id == "acme"
    assert await cache.key(token) is entry  # cached by the read the first caller started
