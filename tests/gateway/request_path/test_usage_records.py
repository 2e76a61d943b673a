"""One usage record per request, whatever happens: client disconnects, database outages."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from gateway.app import SPILL_FILENAME
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.storage.usage_store import UsageEntry
from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.polling import eventually, wait_until
from tests.support.stand_in_stack import tenant_key


def engine_gauge(socket_path: str, name: str) -> float:
    transport = httpx.HTTPTransport(uds=socket_path)
    with httpx.Client(transport=transport, base_url="http://engine") as client:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in the engine's metrics")


def engine_is_idle(engines: Engines) -> bool:
    return engine_gauge(engines.sockets[SMALL], "tollway_engine_requests_running") == 0


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
    assert record.finish_reason is None  # it left before the engine's finish chunk
    assert num_read <= record.completion_tokens < 1500
    await assert_settled_to(record, redis_url, tenant_id)
    # The engine was told: its request is aborted, not generated to the end.
    await eventually(lambda: engine_is_idle(engines), 10, "the engine to stop generating")


def spilled_request_ids(data_dir: Path) -> list[str]:
    """The request ids of the records the gateway's usage writer holds in its spill file."""
    path = data_dir / SPILL_FILENAME
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["request_id"] for line in lines]


def test_usage_record_written_after_a_database_outage(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> None:
    """Answered while the database takes no writes, the record is kept on disk (the spill
    file) and written once the database takes writes again."""
    data_dir = tmp_path / "gw"
    base = gateway(settings_for(engines, data_dir, db_url))
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
        wait_until(lambda: spilled_request_ids(data_dir), 10, "the record in the spill file")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    (request_id,) = spilled_request_ids(data_dir)
    (record,) = usage_records(db_url, tenant_id, 1, timeout=30)
    assert record.request_id == request_id
    assert record.status.value == "completed"
    assert record.completion_tokens == response.json()["usage"]["completion_tokens"]
    wait_until(lambda: not spilled_request_ids(data_dir), 10, "the spill file emptied")


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
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        # The client hangs up once the engine generates, not after a fixed wait: how long
        # the answer takes is the machine's business.
        answer = asyncio.ensure_future(
            client.post(
                "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
        )
        await eventually(
            lambda: (
                engine_gauge(engines.sockets[SMALL], "tollway_engine_generation_tokens_total")
                > generated_before
            ),
            what="generation under way",
        )
        answer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await answer
    (record,) = usage_records(db_url, tenant_id, 1)
    assert record.status.value == "cancelled"
    assert record.finish_reason == "abort"  # the engine's answer once asked to stop
    # The engine was asked to stop and answered with its usage: every token it generated
    # for the request is charged, and it stopped well before max_tokens.
    generated = (
        engine_gauge(engines.sockets[SMALL], "tollway_engine_generation_tokens_total")
        - generated_before
    )
    assert 0 < record.completion_tokens == generated < 1500
    await assert_settled_to(record, redis_url, tenant_id)
    await eventually(lambda: engine_is_idle(engines), 10, "the engine to stop generating")


def finish_reason_sent(response: httpx.Response, stream: bool) -> str | None:
    """The finish reason the client got: a whole answer's, or a stream's finish chunk's."""
    assert response.status_code == 200, response.text
    if not stream:
        return str(response.json()["choices"][0]["finish_reason"])
    reasons = [
        choice["finish_reason"]
        for line in response.text.splitlines()
        if line.startswith("data: {")
        for choice in json.loads(line[6:])["choices"]
        if choice["finish_reason"] is not None
    ]
    assert len(reasons) == 1
    return str(reasons[0])


@pytest.mark.parametrize("stream", [False, True])
def test_the_record_keeps_the_finish_reason_the_engine_sent(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path, stream: bool
) -> None:
    """A max_tokens cut is "length"; an answer that reaches a stop string is "stop"."""
    base = gateway(settings_for(engines, tmp_path / "gw", db_url))
    tenant_id, key = tenant_key(db_url)
    headers = {"authorization": f"Bearer {key}"}
    body = {
        "model": SMALL,
        "messages": [{"role": "user", "content": "Say something"}],
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": 6,
    }
    url = base + "/v1/chat/completions"
    first = httpx.post(url, json=body, headers=headers, timeout=60)  # the greedy answer's text
    text = first.json()["choices"][0]["message"]["content"]
    assert text
    cut = httpx.post(url, json={**body, "stream": stream}, headers=headers, timeout=60)
    stopped = httpx.post(
        url,
        json={**body, "stream": stream, "max_tokens": 12, "stop": [text]},
        headers=headers,
        timeout=60,
    )
    assert finish_reason_sent(cut, stream) == "length"
    assert finish_reason_sent(stopped, stream) == "stop"
    records = usage_records(db_url, tenant_id, 3)
    assert [(r.streamed, r.finish_reason) for r in records] == [
        (False, "length"),
        (stream, "length"),
        (stream, "stop"),
    ]
