"""Budgets below the tenant, and budgets in money, are never exceeded by concurrent requests
sent to two gateway replicas that share one Redis (the overspend test of
``test_budget_reservations``, repeated for a key's, an end user's and money budgets).

Each request reserves its worst case against every budget that applies, the tenant's, its
key's and its end user's, in one Redis script: tokens as the prompt plus ``max_tokens``, money
as the prompt at the input price plus ``max_tokens`` at the output price. With ``ignore_eos``
every request runs to ``max_tokens``, and the budget is sized so that a reservation one token
(or one micro) short would fit it exactly ten times: the budget holds only if the reservation
is exact and the two replicas' reservations are atomic against each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.storage.api_keys import list_keys
from gateway.storage.database import Database
from gateway.storage.scoped_budgets import put_budget
from policies.scoped_budgets import BudgetScope, BudgetUnit, ScopedBudget
from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_stack import tenant_key

NUM_REQUESTS = 30
USER = "alice"
# settings_for's prices, in micros per token: input 1, output 2.
INPUT_MICROS, OUTPUT_MICROS = 1, 2
LEVEL_WORDS = {
    "tenant": "your tenant's budget",
    "key": "the API key's budget",
    "user": "the end user's budget",
}


@pytest.mark.parametrize(
    ("scope", "unit"),
    [
        ("key", "tokens"),
        ("user", "tokens"),
        ("key", "micros"),
        ("user", "micros"),
        ("tenant", "micros"),
    ],
)
async def test_two_replicas_never_overspend_a_key_user_or_money_budget(
    engines: Engines,
    gateway: Callable[..., str],
    db_url: str,
    tmp_path: Path,
    redis_url: str,
    scope: BudgetScope,
    unit: BudgetUnit,
) -> None:
    replicas = [
        gateway(settings_for(engines, tmp_path / f"gw{n}", db_url, redis_url=redis_url))
        for n in range(2)
    ]
    _, unlimited_key = tenant_key(db_url)
    body: dict[str, Any] = {"model": SMALL, "prompt": "Tell me about the sea", "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        probe = await client.post(
            f"{replicas[0]}/v1/completions",
            json={**body, "max_tokens": 1},
            headers={"authorization": f"Bearer {unlimited_key}"},
        )
        prompt_tokens = probe.json()["usage"]["prompt_tokens"]
        max_tokens = 18 - prompt_tokens
        assert max_tokens >= 2
        if unit == "tokens":
            reservation = prompt_tokens + max_tokens
        else:
            reservation = prompt_tokens * INPUT_MICROS + max_tokens * OUTPUT_MICROS
        limit = 10 * (reservation - 1)
        # The tenant's own token budget is ample: the budget under test is the one to refuse.
        quota: dict[str, Any] = {"budget_tokens": 10**9, "budget_period": "total"}
        if scope == "tenant":
            quota["budget_micros"] = limit
        tenant_id, key = tenant_key(db_url, **quota)
        if scope != "tenant":
            subject = _key_id(db_url, tenant_id) if scope == "key" else USER
            database = Database(db_url)
            try:
                with database.transaction() as session:
                    put_budget(
                        session, tenant_id, ScopedBudget(scope, unit, limit, "total", subject)
                    )
            finally:
                database.dispose()
        headers = {"authorization": f"Bearer {key}"}
        request = {**body, "max_tokens": max_tokens, "user": USER}
        answers = await asyncio.gather(
            *(
                client.post(f"{replicas[n % 2]}/v1/completions", json=request, headers=headers)
                for n in range(NUM_REQUESTS)
            )
        )
        statuses = sorted({a.status_code for a in answers})
        assert statuses == [200, 429], [a.text for a in answers if a.status_code not in (200, 429)]
        refusals = [a.json()["error"] for a in answers if a.status_code == 429]
        records = usage_records(db_url, tenant_id, NUM_REQUESTS)
        standings = (
            await client.get(f"{replicas[1]}/v1/budget?user={USER}", headers=headers)
        ).json()["budgets"]

    for error in refusals:
        assert error["code"] == "insufficient_quota"
        assert LEVEL_WORDS[scope] in error["message"], error["message"]
        assert ("micros" in error["message"]) == (unit == "micros"), error["message"]
    assert all(r.end_user == USER for r in records)
    served = [r for r in records if r.status.value == "completed"]
    assert len(served) == sum(a.status_code == 200 for a in answers)
    if unit == "tokens":
        charged = sum(r.prompt_tokens + r.completion_tokens for r in served)
    else:
        charged = sum(r.cost_micros for r in served)
    assert all(r.completion_tokens == max_tokens for r in served)
    (standing,) = [s for s in standings if (s["scope"], s["unit"]) == (scope, unit)]
    assert (standing["used"], standing["reserved"]) == (charged, 0)
    assert charged <= limit  # never overspent
    # and the budget was used up, not refused early: a request costs at most `reservation`
    assert limit - charged < reservation


def _key_id(db_url: str, tenant_id: str) -> str:
    database = Database(db_url)
    try:
        with database.session() as session:
            (only,) = list_keys(session, tenant_id)
            return only.id
    finally:
        database.dispose()
