"""A token budget is never exceeded by concurrent requests, on either ledger, with one
choice or several.

Each request reserves its prompts' tokens plus ``max_tokens`` for each of its choices (``n``
per prompt) before it is forwarded, and is then charged what the engine reports: each prompt
once, and every choice's completion tokens. With ``ignore_eos`` the engine generates exactly
``max_tokens`` for each choice, so the budget holds if and only if the reservation counts the
prompts exactly as the engine does (the Llama tokenizer's BOS on ``/v1/completions``
included) and multiplies ``max_tokens`` by the choices. ``max_tokens`` is chosen so that a
reservation one token short would fit the budget exactly 10 times: with one choice, 10
requests reserving 17 each in a budget of 170, then spending 180 (the issue's case).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_stack import tenant_key

NUM_REQUESTS = 30
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"prompt": "Tell me about the sea"}),
    "completions-ids": ("/v1/completions", {"prompt": [17, 42, 99, 7]}),
    "completions-list": ("/v1/completions", {"prompt": ["The sea", "A ship on it"]}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}]},
    ),
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("ledger", ["memory", "redis"])
@pytest.mark.parametrize("endpoint", list(BODIES))
async def test_concurrent_requests_never_overspend_the_budget(
    engines: Engines,
    gateway: Callable[..., str],
    db_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    ledger: str,
    endpoint: str,
    n: int,
) -> None:
    redis_url = request.getfixturevalue("redis_url") if ledger == "redis" else None
    base = gateway(settings_for(engines, tmp_path / "gw", db_url, redis_url=redis_url))
    _, unlimited_key = tenant_key(db_url)
    path, prompt = BODIES[endpoint]
    body = {"model": SMALL, "ignore_eos": True, "n": n, **prompt}
    num_choices = n * (len(prompt["prompt"]) if endpoint == "completions-list" else 1)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        probe = await client.post(
            path,
            json={**body, "max_tokens": 1},
            headers={"authorization": f"Bearer {unlimited_key}"},
        )
        prompt_tokens = probe.json()["usage"]["prompt_tokens"]  # every prompt once
        # One choice: reservations of 17 in a budget of 170 (the case); several: 4
        # tokens each. Either way a reservation one token short would fit 10 times exactly.
        max_tokens = 18 - prompt_tokens if num_choices == 1 else 4
        assert max_tokens >= 2
        budget_tokens = 10 * (prompt_tokens + num_choices * max_tokens - 1)
        tenant_id, key = tenant_key(db_url, budget_tokens=budget_tokens, budget_period="total")
        client.headers["authorization"] = f"Bearer {key}"
        body["max_tokens"] = max_tokens
        answers = await asyncio.gather(*(client.post(path, json=body) for _ in range(NUM_REQUESTS)))
        statuses = sorted({a.status_code for a in answers})
        assert statuses == [200, 429], [a.text for a in answers if a.status_code not in (200, 429)]
        served = [a.json()["usage"] for a in answers if a.status_code == 200]
        records = usage_records(db_url, tenant_id, NUM_REQUESTS)
        budget = (await client.get("/v1/budget")).json()

    expected_completion = num_choices * max_tokens  # every choice ran to max_tokens
    assert all(u == {**served[0], "completion_tokens": expected_completion} for u in served)
    assert all(len(a.json()["choices"]) == num_choices for a in answers if a.status_code == 200)
    charged = sum(r.prompt_tokens + r.completion_tokens for r in records)
    assert charged == sum(u["total_tokens"] for u in served)
    assert budget["reserved"] == 0
    assert budget["used"] == charged <= budget_tokens
    # and the budget was used up, not refused early: no room left for one more request
    assert budget_tokens - charged < served[0]["total_tokens"]
