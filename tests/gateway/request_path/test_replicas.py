"""Two gateway instances sharing one Redis and one database: budgets and revocation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from gateway.ledger_redis import RedisBudgetLedger
from gateway.storage.api_keys import list_keys, revoke_key
from gateway.storage.database import Database

from .conftest import SMALL, Engines, settings_for, tenant_key
from .test_openai_sdk import usage_records

MAX_TOKENS = 8


def chat(max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": SMALL,
        "messages": [{"role": "user", "content": "Count to ten"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # every admitted request uses exactly what it reserved
    }


@pytest.fixture
def two_gateways(
    engines: Engines, gateway: Callable[..., str], db_url: str, redis_url: str, tmp_path: Path
) -> tuple[str, str]:
    return (
        gateway(settings_for(engines, tmp_path / "a", db_url, redis_url=redis_url)),
        gateway(settings_for(engines, tmp_path / "b", db_url, redis_url=redis_url)),
    )


async def test_budget_is_exact_under_200_concurrent_requests_on_two_replicas(
    two_gateways: tuple[str, str], db_url: str, redis_url: str
) -> None:
    budget = 1000
    tenant_id, key = tenant_key(db_url, budget_tokens=budget, budget_period="total")
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=300)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:
        probe = await client.post(two_gateways[0] + "/v1/chat/completions", json=chat())
        assert probe.status_code == 200, probe.text
        cost = probe.json()["usage"]["total_tokens"]  # prompt + max_tokens: the reservation
        burst = await asyncio.gather(
            *(
                client.post(two_gateways[n % 2] + "/v1/chat/completions", json=chat())
                for n in range(200)
            )
        )
        statuses = [r.status_code for r in burst]
        assert set(statuses) <= {200, 429}
        assert all(
            r.json()["error"]["code"] == "insufficient_quota" for r in burst if r.status_code == 429
        )

        redis = Redis.from_url(redis_url)
        try:
            balance = await RedisBudgetLedger(redis).balance(tenant_id, "total")
        finally:
            await redis.aclose()
        assert balance.reserved == 0
        assert balance.used <= budget
        # Nothing that fitted was refused: exactly as many as the budget holds got through.
        assert 1 + statuses.count(200) == budget // cost
        assert balance.used == (budget // cost) * cost

        # Once settled, a request that fits the remainder is admitted, one that doesn't is not.
        remaining = budget - balance.used
        prompt_tokens = cost - MAX_TOKENS
        if remaining > prompt_tokens:
            fits = chat(max_tokens=remaining - prompt_tokens)
            answer = await client.post(two_gateways[1] + "/v1/chat/completions", json=fits)
            assert answer.status_code == 200, answer.text
        refused = await client.post(two_gateways[0] + "/v1/chat/completions", json=chat(1))
        assert refused.status_code == 429

    completed = [r for r in usage_records(db_url, tenant_id, 202) if r.status.value == "completed"]
    assert sum(r.prompt_tokens + r.completion_tokens for r in completed) <= budget


def test_a_key_revoked_on_one_instance_is_refused_on_the_other(
    two_gateways: tuple[str, str], db_url: str
) -> None:
    tenant_id, key = tenant_key(db_url)
    headers = {"authorization": f"Bearer {key}"}
    first, second = two_gateways
    with httpx.Client(timeout=60, headers=headers) as client:
        for base in two_gateways:
            assert client.post(base + "/v1/chat/completions", json=chat(1)).status_code == 200
        database = Database(db_url)  # the storage layer an admin API on `first` writes through
        try:
            with database.transaction() as session:
                (info,) = list_keys(session, tenant_id)
                assert revoke_key(session, info.id)
        finally:
            database.dispose()
        refused = client.post(second + "/v1/chat/completions", json=chat(1))
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert client.post(first + "/v1/chat/completions", json=chat(1)).status_code == 401
