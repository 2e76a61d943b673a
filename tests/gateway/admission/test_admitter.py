"""The admitter end to end, without torch: a real gateway in front of the stand-in engine,
whose tap shows what was forwarded. A request reserves its prompt as the gateway counts it
(without a checkpoint: OpenAI's rules for chat, ``cl100k_base``) plus its ``max_tokens``, and
is then charged what the engine reports (the stand-in: one prompt token per word,
``NUM_CHUNKS`` completion tokens). Then, without a server, how the admitter decides afresh
when the caller's tenant changed while it decided (``test_planning_step.py`` and
``test_counting_step.py`` check its two steps)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admission.admitter import Admitter
from gateway.admission.counting_step import CountingStep
from gateway.admission.memory_admission_store import MemoryAdmissionStore
from gateway.admission.outcomes import Admission, Refusal
from gateway.admission.planning_step import PlanningStep
from gateway.admission.token_counter import for_openai_model
from gateway.auth.bearer_keys import Caller
from gateway.auth.epochs import INITIAL_EPOCH, MemoryAuthEpochs
from gateway.auth.key_cache import CachedKey
from gateway.completion_body import CompletionBody
from gateway.errors import ApiError
from gateway.ledger.balance_rebuild import BalanceRebuild
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.rollouts import LiveRollouts
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from policies.quota import TenantQuota
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL
from tests.support.stand_in_stack import (
    TappedEngine,
    gateway,
    stand_in_engine,
    stand_in_settings,
    tenant_key,
)

NUM_CHUNKS = 4
MESSAGES = [{"role": "user", "content": "three word prompt"}]  # 3 prompt tokens to the stand-in
PROMPT_TOKENS = for_openai_model(MODEL).count_chat(MESSAGES)  # as the gateway reserves them
CHARGED = 3 + NUM_CHUNKS  # what the stand-in reports


@pytest.fixture
def stack(sqlite_db_url: str, tmp_path: Path) -> Iterator[tuple[TappedEngine, str]]:
    """``(engine, base_url)``: the tapped stand-in and a gateway with SQLite and no Redis."""
    with (
        stand_in_engine(num_chunks=NUM_CHUNKS) as engine,
        gateway(stand_in_settings(engine, tmp_path / "gw", sqlite_db_url)) as base,
    ):
        yield engine, base


def _chat(base: str, key: str, **fields: Any) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": MESSAGES, **fields},
        timeout=30,
    )


def _budget(base: str, key: str) -> dict[str, Any]:
    response = httpx.get(f"{base}/v1/budget", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    budget: dict[str, Any] = response.json()
    return budget


def test_a_request_holds_its_reservation_while_the_engine_works(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    _, key = tenant_key(sqlite_db_url, budget_tokens=100, budget_period="total")
    engine.hold()
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(_chat(base, key, max_tokens=40)))
    request.start()
    try:
        wait_until(lambda: engine.num_held == 1, what="the request reached the engine")
        assert _budget(base, key)["reserved"] == PROMPT_TOKENS + 40
        assert _budget(base, key)["used"] == 0
    finally:
        engine.release()
        request.join(timeout=30)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    budget = _budget(base, key)
    assert budget["reserved"] == 0
    assert budget["used"] == answer.json()["usage"]["total_tokens"] == CHARGED


def test_a_held_reservation_refuses_what_would_overspend_until_it_is_settled(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    budget_tokens = PROMPT_TOKENS + 40
    _, key = tenant_key(sqlite_db_url, budget_tokens=budget_tokens, budget_period="total")
    engine.hold()
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(_chat(base, key, max_tokens=40)))
    first.start()
    try:
        wait_until(lambda: engine.num_held == 1, what="the first request reached the engine")
        assert _budget(base, key)["reserved"] == budget_tokens  # all of it, held
        refused = _chat(base, key, max_tokens=20)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "insufficient_quota"
        assert len(engine.requests) == 1  # the refused one never reached the engine
    finally:
        engine.release()
        first.join(timeout=30)
    assert answers[0].status_code == 200
    assert _budget(base, key)["reserved"] == 0  # settled to CHARGED: the rest is free again
    admitted = _chat(base, key, max_tokens=20)
    assert admitted.status_code == 200, admitted.text
    assert len(engine.requests) == 2
    budget = _budget(base, key)
    assert (budget["limit"], budget["used"], budget["reserved"]) == (
        budget_tokens,
        2 * CHARGED,
        0,
    )


def test_a_request_larger_than_the_whole_budget_never_reaches_the_engine(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    _, key = tenant_key(sqlite_db_url, budget_tokens=PROMPT_TOKENS + 30, budget_period="total")
    refused = _chat(base, key, max_tokens=31)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert engine.requests == []
    assert _budget(base, key)["reserved"] == 0


def test_an_unknown_or_forbidden_model_never_reaches_the_engine(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    _, key = tenant_key(sqlite_db_url)
    unknown = _chat(base, key, model="no-such-model", max_tokens=4)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    _, limited = tenant_key(sqlite_db_url, allowed_models=["some-other-model"])
    forbidden = _chat(base, limited, max_tokens=4)
    assert forbidden.status_code == 403, forbidden.text
    assert engine.requests == []


def test_the_output_cap_decides_the_max_tokens_forwarded(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    _, clamped = tenant_key(
        sqlite_db_url, max_output_tokens=5, clamp_max_output=True, default_max_output_tokens=3
    )
    assert _chat(base, clamped, max_tokens=50).status_code == 200
    assert _chat(base, clamped).status_code == 200  # no max_tokens: the tenant's default
    assert [body["max_tokens"] for _, body in engine.requests] == [5, 3]
    _, strict = tenant_key(sqlite_db_url, max_output_tokens=5)
    refused = _chat(base, strict, max_tokens=50)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid_value"
    assert len(engine.requests) == 2


def test_requests_over_the_rate_limit_are_refused_before_the_engine(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    _, key = tenant_key(sqlite_db_url, rpm=2)
    statuses = [_chat(base, key, max_tokens=4).status_code for _ in range(2)]
    refused = _chat(base, key, max_tokens=4)
    assert statuses == [200, 200]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 0 < int(refused.headers["retry-after"]) <= 60
    assert len(engine.requests) == 2


# -- deciding afresh when the tenant changed (no server) -----------------------------------


class NoLoad:
    async def load(self, model: str) -> None:
        return None


class ReloadedKeys:
    """`KeyCache.reload` as the database answers it: the key under the tenant's new quota."""

    def __init__(self, quota: TenantQuota) -> None:
        self.quota = quota
        self.reloads: list[str] = []

    async def reload(self, entry: CachedKey, epoch: str) -> CachedKey:
        self.reloads.append(epoch)
        caller = Caller(entry.caller.key_id, entry.caller.tenant_id, self.quota, None)
        return CachedKey(caller, entry.key_hash, epoch, None, 0.0, 0.0)


def admitter(db: Database, epochs: MemoryAuthEpochs, keys: ReloadedKeys) -> Admitter:
    settings = GatewaySettings.from_dict(
        {"models": {MODEL: {"upstreams": ["http://127.0.0.1:1"], "context_window": 4096}}}
    )
    ledger = MemoryBudgetLedger()
    planning = PlanningStep(
        settings, {MODEL: for_openai_model(MODEL)}, LiveRollouts(settings.rollouts), NoLoad()
    )
    store = MemoryAdmissionStore(ledger, MemoryRateLimitStore(), epochs)
    rebuild = BalanceRebuild(ledger, db)
    counting = CountingStep(store, epochs, rebuild, reservation_ttl_s=60, is_fail_open=False)
    return Admitter(planning, counting, keys)  # type: ignore[arg-type]


def cached_key(quota: TenantQuota) -> CachedKey:
    return CachedKey(Caller("key-1", "acme", quota, None), "hash", INITIAL_EPOCH, None, 0.0, 0.0)


BODY = CompletionBody("chat", {}, MODEL, MESSAGES, None, 40, False, False)


async def test_a_refusal_under_a_quota_changed_meanwhile_is_decided_again(
    db: Database,
) -> None:
    epochs = MemoryAuthEpochs()
    keys = ReloadedKeys(TenantQuota(max_output_tokens=100))
    await epochs.bump("acme")  # the cap was raised after the key was cached
    admission = await admitter(db, epochs, keys).admit(
        cached_key(TenantQuota(max_output_tokens=10)), BODY, None
    )
    assert isinstance(admission, Admission)
    assert admission.max_tokens == 40
    assert keys.reloads == [epochs.current_now("acme")]


async def test_a_refusal_under_the_current_quota_stands(db: Database) -> None:
    keys = ReloadedKeys(TenantQuota())
    refusal = await admitter(db, MemoryAuthEpochs(), keys).admit(
        cached_key(TenantQuota(max_output_tokens=10)), BODY, None
    )
    assert isinstance(refusal, Refusal)
    assert refusal.rejection.status == 400
    assert keys.reloads == []


async def test_a_tenant_that_keeps_changing_is_a_503(db: Database) -> None:
    epochs = MemoryAuthEpochs()

    class EverChanging(ReloadedKeys):
        async def reload(self, entry: CachedKey, epoch: str) -> CachedKey:
            await epochs.bump("acme")
            return CachedKey(entry.caller, entry.key_hash, epoch, None, 0.0, 0.0)

    await epochs.bump("acme")
    with pytest.raises(ApiError) as caught:
        await admitter(db, epochs, EverChanging(TenantQuota())).admit(
            cached_key(TenantQuota()), BODY, None
        )
    assert caught.value.rejection.status == 503
