"""The filter of the keys that exist, over a real migrated database (SQLite, and PostgreSQL
where the query differs in kind: ``substr``, a streamed result, ``created_at`` compared): what
it reads and when (the refusals it makes for the key cache are in ``test_unknown_keys``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest

from gateway.auth.epochs import MemoryAuthEpochs
from gateway.auth.known_key_filter import MAX_UNPROMPTED_REFRESHES, KnownKeyFilter
from gateway.storage.api_keys import generate_key, hash_key
from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from tests.gateway.auth.key_rows import counted_reads, database_unreachable, store_keys

LONG_AGO = datetime(2020, 1, 1, tzinfo=timezone.utc)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request: pytest.FixtureRequest) -> Iterator[Database]:
    """A migrated database of each backend."""
    if request.param == "sqlite":
        yield request.getfixturevalue("db")
        return
    server = request.getfixturevalue("postgres_server")
    name = f"t_{uuid.uuid4().hex[:16]}"
    server.execute(f"CREATE DATABASE {name}")
    database = Database(server.url(name))
    try:
        upgrade(database.url)
        yield database
    finally:
        database.dispose()
        server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def key_hashes(num_keys: int) -> tuple[list[str], list[str]]:
    tokens = [generate_key() for _ in range(num_keys)]
    return tokens, [hash_key(token) for token in tokens]


async def test_a_refresh_reads_only_the_rows_created_since_the_last_load(any_db: Database) -> None:
    epochs = MemoryAuthEpochs()
    known = KnownKeyFilter(any_db, epochs, window_s=5, clock=Clock())
    old, old_hashes = key_hashes(300)
    store_keys(any_db, old, created_at=LONG_AGO)
    assert not await known.may_hold(hash_key(generate_key()))  # the first load: every row
    assert known.num_rows_last_read == len(known) == 300
    new, new_hashes = key_hashes(2)
    store_keys(any_db, new)
    await epochs.bump("acme")  # as the admin API does after its commit
    assert await known.may_hold(new_hashes[0])
    assert known.num_rows_last_read == 2  # the new rows only
    assert len(known) == 302
    assert all([await known.may_hold(key_hash) for key_hash in old_hashes + new_hashes])


async def test_many_new_keys_are_merged_in_order(any_db: Database) -> None:
    epochs = MemoryAuthEpochs()
    known = KnownKeyFilter(any_db, epochs, window_s=5, clock=Clock())
    first, first_hashes = key_hashes(500)
    store_keys(any_db, first)
    assert await known.may_hold(first_hashes[0])
    more, more_hashes = key_hashes(1500)  # beyond one-by-one insertion
    store_keys(any_db, more)
    await epochs.bump("acme")
    with counted_reads(any_db) as reads:
        assert all([await known.may_hold(key_hash) for key_hash in first_hashes + more_hashes])
    assert len(reads) == 1
    assert len(known) == 2000
    assert not await known.may_hold(hash_key(generate_key()))


async def test_misses_after_a_bump_share_one_refresh(any_db: Database) -> None:
    epochs = MemoryAuthEpochs()
    known = KnownKeyFilter(any_db, epochs, window_s=5, clock=Clock())
    assert not await known.may_hold(hash_key(generate_key()))
    token, key_hash = key_hashes(1)
    store_keys(any_db, token)
    await epochs.bump("acme")
    junk = [hash_key(generate_key()) for _ in range(200)]
    with counted_reads(any_db) as reads:
        answers = await asyncio.gather(*(known.may_hold(h) for h in junk + key_hash))
    assert answers == [False] * len(junk) + [True]
    assert len(reads) == 1


async def test_a_burst_for_a_key_written_in_the_database_waits_for_the_read_under_way(
    any_db: Database,
) -> None:
    """No epoch explains the misses (the key was written straight into the database): the
    burst's first miss starts a read, the others wait for it instead of spending the
    window's refreshes, and none is refused."""
    known = KnownKeyFilter(any_db, MemoryAuthEpochs(), window_s=5, clock=Clock())
    assert not await known.may_hold(hash_key(generate_key()))
    token, key_hash = key_hashes(1)
    store_keys(any_db, token)
    with counted_reads(any_db) as reads:
        answers = await asyncio.gather(*(known.may_hold(key_hash[0]) for _ in range(200)))
    assert answers == [True] * 200
    assert len(reads) == 1


async def test_misses_the_epoch_does_not_explain_refresh_a_few_times_a_window(
    db: Database,
) -> None:
    clock = Clock()
    known = KnownKeyFilter(db, MemoryAuthEpochs(), window_s=5, clock=clock)
    assert not await known.may_hold(hash_key(generate_key()))
    with counted_reads(db) as reads:
        for _ in range(100):
            assert not await known.may_hold(hash_key(generate_key()))
        assert len(reads) == MAX_UNPROMPTED_REFRESHES
        clock.now += 4.9
        assert not await known.may_hold(hash_key(generate_key()))
        assert len(reads) == MAX_UNPROMPTED_REFRESHES
        clock.now += 0.1  # the first of them is a window old
        assert not await known.may_hold(hash_key(generate_key()))
        assert len(reads) == MAX_UNPROMPTED_REFRESHES + 1


async def test_a_failed_refresh_keeps_the_filter_and_answers_maybe(db: Database) -> None:
    epochs = MemoryAuthEpochs()
    known = KnownKeyFilter(db, epochs, window_s=5, clock=Clock())
    token, key_hash = key_hashes(1)
    store_keys(db, token)
    with database_unreachable(db):
        assert await known.may_hold(hash_key(generate_key()))  # never loaded: maybe
    assert len(known) == 0
    assert await known.may_hold(key_hash[0])  # loaded now
    await epochs.bump("acme")
    with database_unreachable(db):
        assert await known.may_hold(hash_key(generate_key()))
        assert await known.may_hold(key_hash[0])
    assert len(known) == 1
    assert not await known.may_hold(hash_key(generate_key()))
