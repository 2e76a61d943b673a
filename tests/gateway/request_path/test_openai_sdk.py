"""The official ``openai`` SDK, unmodified, against a gateway in front of real tiny engines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.storage.database import Database
from gateway.storage.usage_store import MAX_PAGE_SIZE, list_usage
from tests.gateway.request_path.conftest import METRICS_AUTH, SMALL, Engines, settings_for
from tests.support.polling import wait_until
from tests.support.stand_in_stack import tenant_key


def usage_records(db_url: str, tenant_id: str, count: int, timeout: float = 10.0) -> list:
    """The tenant's usage records (up to a page's worth), once ``count`` of them are in the
    database."""
    assert count <= MAX_PAGE_SIZE, "one page of records"
    database = Database(db_url)
    records: list[Any] = []
    try:

        def have_landed() -> bool:
            with database.session() as session:
                records[:] = list_usage(session, tenant_id=tenant_id, limit=MAX_PAGE_SIZE).records
            return len(records) >= count

        wait_until(have_landed, timeout, f"{count} usage records")
        return records
    finally:
        database.dispose()


@pytest.fixture
def served(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> tuple[str, str, str]:
    """``(base_url, tenant_id, key)`` of a gateway with one budgeted tenant."""
    tenant_id, key = tenant_key(db_url, budget_tokens=100_000, budget_period="day")
    base = gateway(settings_for(engines, tmp_path / "gw", db_url))
    return base, tenant_id, key


def test_sync_chat_and_completion(served: tuple[str, str, str], db_url: str) -> None:
    base, tenant_id, key = served
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(
        model=SMALL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None
    assert chat.usage.completion_tokens <= 5
    text = client.completions.create(model=SMALL, prompt="Once upon a time", max_tokens=4)
    assert text.usage is not None
    assert text.usage.completion_tokens <= 4
    assert [m.id for m in client.models.list().data] == sorted(["auto", SMALL, "tiny-large"])

    records = usage_records(db_url, tenant_id, 2)
    assert [r.status.value for r in records] == ["completed", "completed"]
    assert records[0].prompt_tokens == chat.usage.prompt_tokens
    assert records[0].completion_tokens == chat.usage.completion_tokens
    # prices: 1 micro per input token, 2 per output token (per million: 1e6 / 2e6)
    assert records[0].cost_micros == chat.usage.prompt_tokens + 2 * chat.usage.completion_tokens


async def test_async_streaming_with_and_without_usage(
    served: tuple[str, str, str], db_url: str
) -> None:
    base, tenant_id, key = served
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    stream = await client.chat.completions.create(
        model=SMALL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])

    plain = await client.completions.create(
        model=SMALL, prompt="abc", max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    texts = [chunk async for chunk in plain]
    assert texts
    assert all(getattr(c, "usage", None) is None for c in texts)
    await client.close()

    records = usage_records(db_url, tenant_id, 2)
    assert sorted(r.completion_tokens for r in records) == [3, 6]
    assert all(r.streamed and r.status.value == "completed" for r in records)


def test_every_response_has_a_request_id_and_routing_header(served: tuple[str, str, str]) -> None:
    base, _, key = served
    with httpx.Client(base_url=base, timeout=60) as client:
        assert client.get("/health").headers["x-request-id"].startswith("req_")
        response = client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": "auto",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"].startswith("req_")
        assert response.headers["x-tollway-route"] == f"{SMALL}; reason=default_small"
        code = client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": "auto",
                "messages": [{"role": "user", "content": "```\nprint(1)\n```"}],
                "max_tokens": 2,
            },
        )
        assert code.headers["x-tollway-route"] == "tiny-large; reason=code"
        assert code.json()["model"] == "tiny-large"
        metrics = client.get("/metrics", headers=METRICS_AUTH).text
        series = 'endpoint="chat",model="tiny",status="completed",version="tiny"'
        assert f"tollway_gateway_requests_total{{{series}}}" in metrics
