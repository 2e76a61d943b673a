"""Background settles against a real redis-server that stalls (paused until the test resumes
it): they land once it answers, count once, and stay bounded in number."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.ledger.budget_ledger import Balance
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.ledger.settle_retries import LedgerRetries
from gateway.storage.redis_client import LeanRedis
from tests.support.polling import eventually
from tests.support.redis_server import RedisServer


@pytest.fixture
async def ledger(redis_url: str) -> AsyncIterator[RedisBudgetLedger]:
    client = LeanRedis(redis_url, timeout_s=0.1)
    ledger = RedisBudgetLedger(client)
    await ledger.rebuild("acme", "total", 0)
    yield ledger
    await client.aclose()


async def until_done(retries: LedgerRetries) -> None:
    await eventually(lambda: retries.num_pending == 0, 10, "every retry has landed")


async def test_a_settle_that_times_out_lands_once_redis_answers_and_counts_once(
    ledger: RedisBudgetLedger, redis_server: RedisServer
) -> None:
    retries = LedgerRetries(ledger, first_delay_s=0.05)
    reservation = await ledger.reserve("acme", "total", 1000, 100, 60)
    assert reservation is not None
    with redis_server.paused():
        await retries.settle(reservation, 30)  # times out: sent, and run when Redis wakes
        assert retries.num_pending == 1
    await until_done(retries)
    assert await ledger.balance("acme", "total") == Balance(used=30, reserved=0)


async def test_a_release_in_the_background_frees_the_hold(
    ledger: RedisBudgetLedger, redis_url: str
) -> None:
    retries = LedgerRetries(ledger, first_delay_s=0.05)
    reservation = await ledger.reserve("acme", "total", 1000, 100, 60)
    assert reservation is not None
    retries.later(reservation, 0)
    await until_done(retries)
    assert await ledger.balance("acme", "total") == Balance(used=0, reserved=0)


async def test_retries_are_bounded_in_number_and_dropped_on_close(
    ledger: RedisBudgetLedger, caplog: pytest.LogCaptureFixture
) -> None:
    reservation = await ledger.reserve("acme", "total", 1000, 100, 60)
    assert reservation is not None
    full = LedgerRetries(ledger, max_pending=0)
    full.later(reservation, 30)
    assert full.num_pending == 0
    waiting = LedgerRetries(ledger, first_delay_s=10, max_delay_s=10)
    waiting.later(reservation, 30)
    assert waiting.num_pending == 1
    await asyncio.sleep(0)  # the retry is waiting
    caplog.clear()
    await waiting.aclose()
    assert waiting.num_pending == 0
    assert await ledger.balance("acme", "total") == Balance(used=0, reserved=100)
    lost = [r for r in caplog.records if "never settled" in r.getMessage()]
    assert len(lost) == 1
    assert "30 tokens" in lost[0].getMessage()
