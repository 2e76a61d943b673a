"""One usage record per request, whatever happens: client disconnects, database outages."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.storage.database import Database
from gateway.storage.usage_store import UsageEntry, list_usage
from tests.support.stand_in_stack import tenant_key

from .conftest import SMALL, Engines, settings_for
from .test_openai_sdk import usage_records


def engine_gauge(socket_path: str, name: str) -> float:
    transport = httpx.HTTPTransport(uds=socket_path)
    with httpx.Client(transport=transport, base_url="http://engine") as client:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in the engine's metrics")


async def assert_settled_to(record: UsageEntry, redis_url: str, tenant_id: str) -> None:
    """The tenant's budget holds nothing in reserve and charges exactly ``record``."""
    redis = Redis.from_url(redis_url)
    try:
        balance = await RedisBudgetLedger(redis).balance(tenant_id, "total")
    finally:
        await redis.aclose()
    assert balance.reserved == 0
    assert balance.used == record.prompt_tokens + record.completion_tokens


async def test_disconnect_mid_stream_settles_to_the_tokens_relayed(
    engines: Engines, gateway: Callable[..., str], db_url: str, redis_url: str, tmp_path: Path
) -> None:
    base = gateway(settings_for(engines, tmp_path / "gw", db_url, redis_url=redis_url))
    tenant_id, key = tenant_key(db_url, budget_tokens=100_000, budget_period="total")
    body = {
        "model": SMALL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    num_read = 0
    async with (
        httpx.AsyncClient(base_url=base, timeout=60) as client,
        client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                num_read += 1
                if num_read == 5:
                    break  # leaving the block closes the connection mid-stream

    (record,) = usage_records(db_url, tenant_id, 1)
    assert record.status.value == "cancelled"
    assert num_read <= record.completion_tokens < 1500
    await assert_settled_to(record, redis_url, tenant_id)
    # The engine was told: its request is aborted, not generated to the end.
    deadline = time.monotonic() + 10
    while engine_gauge(engines.sockets[SMALL], "tollway_engine_requests_running") > 0:
        assert time.monotonic() < deadline, "the engine kept generating"
        await asyncio.sleep(0.05)


def test_usage_record_written_after_a_database_outage(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> None:
    base = gateway(settings_for(engines, tmp_path / "gw", db_url))
    tenant_id, key = tenant_key(db_url)
    blocker = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None, timeout=5)
    blocker.execute("BEGIN EXCLUSIVE")  # writers get "database is locked"; WAL readers go on
    try:
        response = httpx.post(
            base + "/v1/completions",
            json={"model": SMALL, "prompt": "Hello", "max_tokens": 3},
            headers={"authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        time.sleep(0.5)
        database = Database(db_url)
        with database.session() as session:
            assert list_usage(session, tenant_id=tenant_id).records == []
        database.dispose()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    (record,) = usage_records(db_url, tenant_id, 1, timeout=30)
    assert record.status.value == "completed"
    assert record.completion_tokens == response.json()["usage"]["completion_tokens"]


async def test_disconnect_before_a_non_streamed_answer_charges_what_the_engine_generated(
    engines: Engines, gateway: Callable[..., str], db_url: str, redis_url: str, tmp_path: Path
) -> None:
    base = gateway(settings_for(engines, tmp_path / "gw", db_url, redis_url=redis_url))
    tenant_id, key = tenant_key(db_url, budget_tokens=100_000, budget_period="total")
    body = {
        "model": SMALL,
        "messages": [{"role": "user", "content": "Tell me a very long story"}],
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    generated_before = engine_gauge(
        engines.sockets[SMALL], "tollway_engine_generation_tokens_total"
    )
    async with httpx.AsyncClient(base_url=base, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
    (record,) = usage_records(db_url, tenant_id, 1)
    assert record.status.value == "cancelled"
    # The engine was asked to stop and answered with its usage: every token it generated
    # for the request is charged, and it stopped well before max_tokens.
    generated = (
        engine_gauge(engines.sockets[SMALL], "tollway_engine_generation_tokens_total")
        - generated_before
    )
    assert 0 < record.completion_tokens == generated < 1500
    await assert_settled_to(record, redis_url, tenant_id)
    deadline = time.monotonic() + 10
    while engine_gauge(engines.sockets[SMALL], "tollway_engine_requests_running") > 0:
        assert time.monotonic() < deadline, "the engine kept generating"
        await asyncio.sleep(0.05)
