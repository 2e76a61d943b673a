"""Redis killed and paused (SIGSTOP) under load: no 500, no answer later than the Redis time
limits allow, a clean 503 in OpenAI's format (or, fail-open, admitted and billed), and the
gateway recovers by itself when Redis is back."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from gateway.storage.models import UsageRecord, UsageStatus
from gateway.storage.usage_store import sum_tokens
from tests.faults.conftest import METRICS_AUTH
from tests.support.polling import eventually, wait_until
from tests.support.stand_in_engine import MODEL

CONNECT_TIMEOUT_S = 0.25
TIMEOUT_S = 0.25
# An answer may wait for one connect and one call; the rest is a busy 2-core machine's slack.
LONGEST_ANSWER_S = CONNECT_TIMEOUT_S + TIMEOUT_S + 1.0
ADMIN_KEY = "admin-key-for-fault-tests"
ALL_TIME = (datetime(1970, 1, 1, tzinfo=timezone.utc), datetime(9999, 1, 1, tzinfo=timezone.utc))
QUOTA = {"rpm": 1_000_000, "budget_tokens": 10**9, "budget_period": "day"}


@dataclass(frozen=True)
class Answer:
    started: float
    elapsed: float
    status: int
    body: dict[str, Any]
    retry_after: str | None


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'tollway.db'}"
    upgrade(url)
    return url


async def under_load(
    base_url: str, key: str, faults: Callable[[], Awaitable[None]], num_workers: int = 6
) -> list[Answer]:
    """Chat requests (plain and streamed, in turn) from ``num_workers`` clients while
    ``faults()`` runs; every answer, in the order they came."""
    answers: list[Answer] = []
    done = asyncio.Event()
    headers = {"authorization": f"Bearer {key}"}

    async def client_loop(client: httpx.AsyncClient, worker: int) -> None:
        n = worker
        while not done.is_set():
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 4,
                "stream": n % 2 == 1,
            }
            started = time.monotonic()
            response = await client.post("/v1/chat/completions", json=body, headers=headers)
            elapsed = time.monotonic() - started
            data = response.json() if response.status_code != 200 else {}
            retry_after = response.headers.get("retry-after")
            answers.append(Answer(started, elapsed, response.status_code, data, retry_after))
            n += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        workers = [asyncio.ensure_future(client_loop(client, w)) for w in range(num_workers)]
        try:
            await faults()
        finally:
            done.set()
            await asyncio.gather(*workers)
    return answers


def assert_clean(answers: list[Answer]) -> None:
    """No 500, no hang: every answer a 200 or OpenAI's 503 with Retry-After, in time."""
    assert answers
    statuses = {a.status for a in answers}
    assert statuses <= {200, 503}, statuses
    for answer in answers:
        if answer.status == 503:
            error = answer.body["error"]
            assert error["type"] == "server_error"
            assert error["code"] in ("service_unavailable", "auth_unavailable")
            assert answer.retry_after == "1"
    slowest = max(a.elapsed for a in answers)
    assert slowest < LONGEST_ANSWER_S, f"an answer took {slowest:.2f} s"


def relative(answers: list[Answer], t0: float) -> list[tuple[float, float, int]]:
    """(started, elapsed, status) with times from ``t0``, to read a failure."""
    return [(round(a.started - t0, 3), round(a.elapsed, 3), a.status) for a in answers]


def completed_tokens(db_url: str, tenant_id: str, num_completed: int) -> int:
    """The tokens the tenant's records charge, once its ``num_completed`` completed ones are
    all in the database."""
    database = Database(db_url)
    completed = (
        select(func.count())
        .select_from(UsageRecord)
        .where(UsageRecord.tenant_id == tenant_id, UsageRecord.status == UsageStatus.COMPLETED)
    )
    try:

        def have_landed() -> bool:
            with database.session() as session:
                return session.scalar(completed) == num_completed

        wait_until(have_landed, 20, f"{num_completed} completed records")
        with database.session() as session:
            totals = sum_tokens(session, tenant_id, ALL_TIME[0], ALL_TIME[1])
        return totals.prompt_tokens + totals.completion_tokens
    finally:
        database.dispose()


def settings_for(
    gateway_settings: Callable[..., GatewaySettings], redis_url: str, db_url: str, **extra: Any
) -> GatewaySettings:
    return gateway_settings(
        database_url=db_url,
        redis_url=redis_url,
        redis_connect_timeout_s=CONNECT_TIMEOUT_S,
        redis_timeout_s=TIMEOUT_S,
        admin_key_hash=hashlib.sha256(ADMIN_KEY.encode()).hexdigest(),
        **extra,
    )


async def read_budget(
    base_url: str, key: str, until_used: int, *, until_unreserved: bool = False
) -> dict[str, Any]:
    """The tenant's /v1/budget, once its ``used`` reaches ``until_used`` and (if asked) its
    ``reserved`` is 0 (within 15 s)."""
    budget: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base_url) as client:
        headers = {"authorization": f"Bearer {key}"}

        async def is_done() -> bool:
            budget.update((await client.get("/v1/budget", headers=headers)).json())
            is_used = budget["used"] >= until_used
            return is_used and (budget["reserved"] == 0 or not until_unreserved)

        await eventually(is_done, 15, f"used >= {until_used}")
    return budget


@pytest.mark.parametrize("redis_process", [True], indirect=True)  # restarts with its data
async def test_redis_killed_mid_load_gives_clean_503s_then_recovers(
    redis_process: Any,
    db_url: str,
    gateway_settings: Callable[..., GatewaySettings],
    serve_gateway: Callable[[GatewaySettings], str],
    make_tenant: Callable[..., tuple[str, str]],
) -> None:
    tenant_id, key = make_tenant(db_url, **QUOTA)
    base_url = serve_gateway(settings_for(gateway_settings, redis_process.url, db_url))
    marks: dict[str, float] = {}
    side_answers: dict[str, int] = {}

    async def faults() -> None:
        await asyncio.sleep(0.5)
        marks["killed"] = time.monotonic()
        redis_process.kill()
        await asyncio.sleep(1.0)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            tenant = {"authorization": f"Bearer {key}"}
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            side_answers["budget"] = (await client.get("/v1/budget", headers=tenant)).status_code
            path = f"/admin/tenants/{tenant_id}/quota"  # committed, then announced: the epoch
            changed = await client.put(path, json=QUOTA, headers=admin)
            side_answers["admin_write"] = changed.status_code
            assert "The change is saved" in changed.json()["error"]["message"]
        marks["restarting"] = time.monotonic()
        await asyncio.to_thread(redis_process.start)
        marks["restarted"] = time.monotonic()
        await asyncio.sleep(1.5)

    answers = await under_load(base_url, key, faults)
    assert_clean(answers)
    # A request on its way (a busy machine, the client and gateway sharing a process) may
    # reach Redis well after it started: the windows keep clear of the edges.
    during = [a for a in answers if marks["killed"] + 0.1 < a.started < marks["restarting"] - 0.5]
    assert during, relative(during, marks["killed"])
    assert all(a.status == 503 for a in during), relative(during, marks["killed"])
    after = [a for a in answers if a.started > marks["restarted"] + 0.5]
    assert after
    assert all(a.status == 200 for a in after)
    assert side_answers == {"budget": 503, "admin_write": 503}
    # Requests running when Redis died could not settle at their end: they settle once it is
    # back (it kept its data), so the ledger's `used` agrees with the records.
    num_completed = sum(a.status == 200 for a in answers)
    billed = completed_tokens(db_url, tenant_id, num_completed)
    assert (await read_budget(base_url, key, billed))["used"] == billed


async def test_redis_paused_mid_load_answers_within_the_timeout_then_recovers(
    redis_process: Any,
    db_url: str,
    gateway_settings: Callable[..., GatewaySettings],
    serve_gateway: Callable[[GatewaySettings], str],
    make_tenant: Callable[..., tuple[str, str]],
) -> None:
    tenant_id, key = make_tenant(db_url, **QUOTA)
    base_url = serve_gateway(settings_for(gateway_settings, redis_process.url, db_url))
    marks: dict[str, float] = {}

    async def faults() -> None:
        await asyncio.sleep(0.5)
        marks["paused"] = time.monotonic()
        redis_process.pause()
        await asyncio.sleep(3.0)  # longer than any answer may take
        redis_process.resume()
        marks["resumed"] = time.monotonic()
        await asyncio.sleep(1.5)

    answers = await under_load(base_url, key, faults)
    assert_clean(answers)
    during = [a for a in answers if marks["paused"] + 0.5 < a.started < marks["resumed"] - 1.0]
    assert during, relative(during, marks["paused"])
    assert all(a.status == 503 for a in during), relative(during, marks["paused"])
    after = [a for a in answers if a.started > marks["resumed"] + 0.5]
    assert after
    assert all(a.status == 200 for a in after)
    # Settles that timed out while Redis was stopped ran when it woke, or ran again: counted
    # once. Admissions whose reply came too late but that reserved all the same are released.
    num_completed = sum(a.status == 200 for a in answers)
    billed = completed_tokens(db_url, tenant_id, num_completed)
    budget = await read_budget(base_url, key, billed, until_unreserved=True)
    assert (budget["used"], budget["reserved"]) == (billed, 0)


async def test_fail_open_admits_and_bills_while_redis_is_down(
    redis_process: Any,
    db_url: str,
    gateway_settings: Callable[..., GatewaySettings],
    serve_gateway: Callable[[GatewaySettings], str],
    make_tenant: Callable[..., tuple[str, str]],
) -> None:
    tenant_id, key = make_tenant(db_url, **QUOTA)
    settings = settings_for(gateway_settings, redis_process.url, db_url, redis_failure_mode="open")
    base_url = serve_gateway(settings)
    marks: dict[str, float] = {}

    async def faults() -> None:
        await asyncio.sleep(0.5)
        redis_process.kill()
        marks["killed"] = time.monotonic()
        await asyncio.sleep(1.5)
        await asyncio.to_thread(redis_process.start)  # empty: balances rebuilt from records
        await asyncio.sleep(1.0)

    answers = await under_load(base_url, key, faults)
    assert_clean(answers)
    assert all(a.status == 200 for a in answers)
    async with httpx.AsyncClient(base_url=base_url) as client:
        metrics = (await client.get("/metrics", headers=METRICS_AUTH)).text
    uncounted = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tollway_gateway_uncounted_admissions_total")
    ]
    assert uncounted
    assert uncounted[0] > 0
    assert completed_tokens(db_url, tenant_id, len(answers)) > 0
