"""Two gateway instances sharing one Redis and one database: budgets, revocation, quotas."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway.ledger.budget_ledger import Balance
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.storage.api_keys import hash_key, list_keys, revoke_key
from gateway.storage.database import Database
from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.polling import eventually
from tests.support.stand_in_stack import tenant_key

MAX_TOKENS = 8


def chat(max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": SMALL,
        "messages": [{"role": "user", "content": "Count to ten"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # every admitted request uses exactly what it reserved
    }


ADMIN_KEY = "admin-" + "r" * 40


@pytest.fixture
def two_gateways(
    engines: Engines, gateway: Callable[..., str], db_url: str, redis_url: str, tmp_path: Path
) -> tuple[str, str]:
    """Two replicas (one Redis, one database), both with the admin API on."""
    shared = {"redis_url": redis_url, "admin_key_hash": hash_key(ADMIN_KEY)}
    return (
        gateway(settings_for(engines, tmp_path / "a", db_url, **shared)),
        gateway(settings_for(engines, tmp_path / "b", db_url, **shared)),
    )


async def settled_balance(redis_url: str, tenant_id: str, period_key: str) -> Balance:
    """The balance once no reservation is held: settling happens after each response is sent."""
    redis = Redis.from_url(redis_url)
    balances: list[Balance] = []
    try:
        ledger = RedisBudgetLedger(redis)

        async def is_settled() -> bool:
            balances.append(await ledger.balance(tenant_id, period_key))
            return balances[-1].reserved == 0

        await eventually(is_settled, 10, "no reservation held")
        return balances[-1]
    finally:
        await redis.aclose()


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

        balance = await settled_balance(redis_url, tenant_id, "total")
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


def completes(client: httpx.Client, base: str) -> int:
    return client.post(base + "/v1/chat/completions", json=chat(1)).status_code


def admin(base: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    response = httpx.request(method, base + path, headers=headers, timeout=60, **kwargs)
    assert response.status_code == 200, response.text
    return response


def test_a_key_revoked_on_one_instance_is_refused_on_the_other(
    two_gateways: tuple[str, str], db_url: str
) -> None:
    tenant_id, key = tenant_key(db_url)
    headers = {"authorization": f"Bearer {key}"}
    first, second = two_gateways
    with httpx.Client(timeout=60, headers=headers) as client:
        for base in two_gateways:  # twice each: both replicas now answer from their key cache
            assert completes(client, base) == 200
            assert completes(client, base) == 200
        (listed,) = admin(first, "GET", f"/admin/tenants/{tenant_id}/keys").json()["data"]
        admin(first, "DELETE", f"/admin/keys/{listed['id']}")
        refused = client.post(second + "/v1/chat/completions", json=chat(1))
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert completes(client, first) == 401
        assert completes(client, second) == 401


def test_a_quota_changed_on_one_instance_applies_at_once_on_the_other(
    two_gateways: tuple[str, str], db_url: str
) -> None:
    tenant_id, key = tenant_key(db_url)
    first, second = two_gateways
    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
        assert completes(client, second) == 200
        admin(first, "PUT", f"/admin/tenants/{tenant_id}/quota", json={"allowed_models": ["x"]})
        refused = client.post(second + "/v1/chat/completions", json=chat(1))
        assert refused.status_code == 403, refused.text
        # ...and a refusal made on the cached quota is checked too: lifting it applies at once.
        admin(first, "PUT", f"/admin/tenants/{tenant_id}/quota", json={})
        assert completes(client, second) == 200
        admin(first, "PUT", f"/admin/tenants/{tenant_id}/quota", json={"rpm": 1})
        assert completes(client, second) == 200
        assert completes(client, second) == 429


def test_a_tenant_deleted_on_one_instance_is_refused_on_the_other(
    two_gateways: tuple[str, str], db_url: str
) -> None:
    tenant_id, key = tenant_key(db_url)
    first, second = two_gateways
    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
        assert completes(client, second) == 200
        admin(first, "DELETE", f"/admin/tenants/{tenant_id}")
        assert completes(client, second) == 401


def revoke_in_the_database(db_url: str, tenant_id: str) -> None:
    """A revocation that bypasses the admin API (so no gateway is told)."""
    database = Database(db_url)
    try:
        with database.transaction() as session:
            (info,) = list_keys(session, tenant_id)
            assert revoke_key(session, info.id)
    finally:
        database.dispose()


@pytest.mark.parametrize(
    ("ttl_s", "status"), [(0.0, 401), (3600.0, 200)], ids=["read-every-time", "from-memory"]
)
def test_a_key_revoked_in_the_database_is_refused_as_the_cache_ttl_says(
    engines: Engines,
    gateway: Callable[..., str],
    db_url: str,
    redis_url: str,
    tmp_path: Path,
    ttl_s: float,
    status: int,
) -> None:
    """``auth_cache_ttl_s`` reaches the key cache: 0 reads the key on every request, so its
    revocation is seen at once; otherwise the key is trusted from memory until the TTL has
    passed (the cache's own tests move its clock past the TTL: `test_key_cache`)."""
    base = gateway(
        settings_for(engines, tmp_path / "gw", db_url, redis_url=redis_url, auth_cache_ttl_s=ttl_s)
    )
    tenant_id, key = tenant_key(db_url)
    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
        assert completes(client, base) == 200
        revoke_in_the_database(db_url, tenant_id)
        assert completes(client, base) == status


def test_an_embedded_gateway_refuses_a_key_revoked_through_its_admin_api_at_once(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> None:
    """No Redis: the admin API tells the same process's key cache."""
    settings = settings_for(engines, tmp_path / "gw", db_url, admin_key_hash=hash_key(ADMIN_KEY))
    base = gateway(settings)
    tenant_id, key = tenant_key(db_url)
    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
        assert completes(client, base) == 200
        assert completes(client, base) == 200
        (listed,) = admin(base, "GET", f"/admin/tenants/{tenant_id}/keys").json()["data"]
        admin(base, "DELETE", f"/admin/keys/{listed['id']}")
        assert completes(client, base) == 401
