"""Background settles against a real redis-server that stalls: they land once it answers,
count once, and stay bounded in number."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis

from gateway.ledger.budget_ledger import Balance
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.ledger.settle_retries import LedgerRetries
from gateway.storage.redis_client import LeanRedis
from tests.gateway.redis_server_state import until_asleep


@pytest.fixture
async def ledger(redis_url: str) -> AsyncIterator[RedisBudgetLedger]:
    client = LeanRedis(redis_url, timeout_s=0.1)
    ledger = RedisBudgetLedger(client)
    await ledger.rebuild("acme", "total", 0)
    yield ledger
    await client.aclose()


def stall(redis_url: str, seconds: float) -> None:
    with redis.Redis.from_url(redis_url) as admin:
        admin.execute_command("DEBUG", "SLEEP", seconds)


async def until_done(retries: LedgerRetries) -> None:
    deadline = time.monotonic() + 5
    while retries.num_pending and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert retries.num_pending == 0


async def test_a_settle_that_times_out_lands_once_redis_answers_and_counts_once(
    ledger: RedisBudgetLedger, redis_url: str
) -> None:
    retries = LedgerRetries(ledger, first_delay_s=0.05)
    reservation = await ledger.reserve("acme", "total", 1000, 100, 60)
    assert reservation is not None
    stalled = asyncio.ensure_future(asyncio.to_thread(stall, redis_url, 0.5))
    await until_asleep(redis_url)
    await retries.settle(reservation, 30)  # times out: sent, and run when Redis wakes
    assert retries.num_pending == 1
    await stalled
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
    assert len(lost) == 1 and "30 tokens" in lost[0].getMessage()  # a dropped settle says so
