"""The counting step without a server: a plan counted in the in-process admission store (the
stores themselves run against Redis in ``test_admission_store.py``), the budget rebuilt from
the usage records, and what a Redis failure becomes in each failure mode."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.admission.admission_store import AdmissionAsk, AdmissionResult, AdmissionTimedOut
from gateway.admission.counting_step import CountingStep
from gateway.admission.memory_admission_store import MemoryAdmissionStore
from gateway.admission.outcomes import Admission, Refusal
from gateway.admission.planning_step import AdmissionPlan
from gateway.auth.bearer_keys import Caller
from gateway.auth.epochs import INITIAL_EPOCH, MemoryAuthEpochs
from gateway.auth.key_cache import CachedKey
from gateway.errors import ApiError
from gateway.ledger.balance_rebuild import BalanceRebuild
from gateway.ledger.budget_ledger import Balance, Reservation
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.observability.metrics import GatewayMetrics
from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.settings import Prices
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry, insert_usage
from policies.quota import TenantQuota

PLAN = AdmissionPlan("small", "small", None, prompt_tokens=10, max_tokens=20, priority="batch")


def _record(prompt_tokens: int, completion_tokens: int) -> UsageEntry:
    now = datetime.now(timezone.utc)
    return UsageEntry(
        "req-1", "acme", "key-1", "small", "small", None, prompt_tokens, 0, completion_tokens,
        0, UsageStatus.COMPLETED, None, False, now,
    )  # fmt: skip


def key(**quota: object) -> CachedKey:
    caller = Caller("key-1", "acme", TenantQuota(**quota), None)  # type: ignore[arg-type]
    return CachedKey(caller, "hash", INITIAL_EPOCH, None, 0.0, 0.0)


@pytest.fixture
def database(sqlite_db_url: str) -> Iterator[Database]:
    database = Database(sqlite_db_url)
    yield database
    database.dispose()


@pytest.fixture
def ledger() -> MemoryBudgetLedger:
    return MemoryBudgetLedger()


@pytest.fixture
def step(ledger: MemoryBudgetLedger, database: Database) -> CountingStep:
    epochs = MemoryAuthEpochs()
    store = MemoryAdmissionStore(ledger, MemoryRateLimitStore(), epochs)
    rebuild = BalanceRebuild(ledger, database)
    return CountingStep(store, epochs, rebuild, reservation_ttl_s=60, is_fail_open=False)


async def test_an_unknown_balance_is_rebuilt_from_the_records_then_reserved(
    step: CountingStep, ledger: MemoryBudgetLedger, database: Database
) -> None:
    with database.transaction() as session:
        insert_usage(session, [_record(prompt_tokens=40, completion_tokens=10)])
    admission = await step.count(key(budget_tokens=100, budget_period="total"), PLAN)
    assert isinstance(admission, Admission)
    assert admission.reservation is not None
    assert admission.reservation.tokens == PLAN.tokens == 30
    period = admission.reservation.period_key
    assert await ledger.balance("acme", period) == Balance(used=50, reserved=30)
    refusal = await step.count(key(budget_tokens=100, budget_period="total"), PLAN)
    assert isinstance(refusal, Refusal)
    assert refusal.rejection.code == "insufficient_quota"


async def test_over_the_budget_is_refused_with_the_plans_facts(step: CountingStep) -> None:
    refusal = await step.count(key(budget_tokens=29, budget_period="total"), PLAN)
    assert isinstance(refusal, Refusal)
    assert (refusal.rejection.status, refusal.rejection.code) == (429, "insufficient_quota")
    assert (refusal.served_model, refusal.version, refusal.prompt_tokens) == ("small", "small", 10)


async def test_over_the_rate_limit_is_refused_and_admitted_hits_get_headers(
    step: CountingStep,
) -> None:
    admitted = await step.count(key(rpm=1), PLAN)
    assert isinstance(admitted, Admission)
    assert admitted.reservation is None
    assert admitted.headers["x-ratelimit-remaining-requests"] == "0"
    refused = await step.count(key(rpm=1), PLAN)
    assert isinstance(refused, Refusal)
    assert refused.rejection.code == "rate_limit_exceeded"


async def test_a_changed_epoch_is_handed_back_uncounted(step: CountingStep) -> None:
    stale = CachedKey(key(rpm=1).caller, "hash", "an-old-epoch", None, 0.0, 0.0)
    changed = await step.count(stale, PLAN)
    assert not isinstance(changed, Admission | Refusal)
    assert changed.epoch == INITIAL_EPOCH
    assert isinstance(await step.count(key(rpm=1), PLAN), Admission)  # nothing was counted


class FailingStore:
    """An admission store whose Redis cannot answer."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def admit(self, ask: AdmissionAsk) -> AdmissionResult:
        raise self.error


class FailingEpochs(MemoryAuthEpochs):
    async def current(self, tenant_id: str) -> str:
        raise RedisConnectionError("down")


class RecordedRetries:
    def __init__(self) -> None:
        self.later_calls: list[tuple[Reservation, int]] = []

    def later(self, reservation: Reservation, used_tokens: int) -> None:
        self.later_calls.append((reservation, used_tokens))


def failing_step(
    database: Database, *, is_fail_open: bool, error: Exception | None = None, **kwargs: object
) -> CountingStep:
    store = FailingStore(error or RedisConnectionError("down"))
    rebuild = BalanceRebuild(MemoryBudgetLedger(), database)
    return CountingStep(
        store,
        FailingEpochs(),
        rebuild,
        reservation_ttl_s=60,
        is_fail_open=is_fail_open,
        **kwargs,  # type: ignore[arg-type]
    )


async def test_fail_closed_answers_503(database: Database) -> None:
    step = failing_step(database, is_fail_open=False)
    with pytest.raises(ApiError) as caught:
        await step.count(key(rpm=1), PLAN)
    assert caught.value.rejection.status == 503
    with pytest.raises(RedisConnectionError):
        await step.current_epoch("acme")


async def test_fail_open_admits_uncounted_and_frees_what_a_late_reply_may_hold(
    database: Database,
) -> None:
    maybe_held = Reservation("r-1", "acme", "total", 30, time.time() + 60)
    metrics, retries = GatewayMetrics(), RecordedRetries()
    step = failing_step(
        database,
        is_fail_open=True,
        error=AdmissionTimedOut("late", maybe_held),
        metrics=metrics,
        retries=retries,
    )
    admission = await step.count(key(rpm=1, budget_tokens=100), PLAN)
    assert admission == PLAN.admit(None)
    assert retries.later_calls == [(maybe_held, 0)]
    assert "tollway_gateway_uncounted_admissions_total 1.0" in metrics.render().decode()
    assert await step.current_epoch("acme") is None


async def test_redis_failures_are_logged_once_a_second_at_most(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    step = failing_step(database, is_fail_open=True, monotonic=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="gateway.admission.counting_step"):
        for at in (100.0, 100.5, 100.9, 101.0):
            now[0] = at
            await step.count(key(rpm=1), PLAN)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert lines[0].endswith("(0 more since the last line)")
    assert lines[1].endswith("(2 more since the last line)")


async def test_a_money_budgets_refusal_names_the_gateways_currency(
    ledger: MemoryBudgetLedger, database: Database
) -> None:
    epochs = MemoryAuthEpochs()
    step = CountingStep(
        MemoryAdmissionStore(ledger, MemoryRateLimitStore(), epochs),
        epochs,
        BalanceRebuild(ledger, database),
        reservation_ttl_s=60,
        is_fail_open=False,
        prices=lambda version: Prices(input=1_000_000, output=2_000_000),
        currency="EUR",
    )
    refusal = await step.count(key(budget_micros=5, budget_period="total"), PLAN)
    assert isinstance(refusal, Refusal)
    message = refusal.rejection.message
    assert "You exceeded your tenant's budget of 0.000005 EUR (5 micros)" in message, message
