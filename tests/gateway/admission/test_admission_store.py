"""One suite, run against both admission stores: in-process, and Redis on a real redis-server
(through redis-py and through the gateway's lean client, ``LeanRedis``).

Each "replica" is a store with the budget ledger and auth epochs it shares state with (memory:
one process, so one of each; Redis: a new client per replica, as separate gateways have).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import pytest
from redis.asyncio import Redis

from gateway.admission.admission_store import (
    AdmissionAsk,
    AdmissionStore,
    AuthChanged,
    BalanceUnknown,
    BudgetAsk,
    Counted,
)
from gateway.admission.memory_admission_store import MemoryAdmissionStore
from gateway.admission.redis_admission_store import RedisAdmissionStore
from gateway.auth.epochs import INITIAL_EPOCH, AuthEpochs, MemoryAuthEpochs, RedisAuthEpochs
from gateway.ledger.budget_ledger import (
    TENANT_TOKENS,
    Balance,
    BudgetAccount,
    BudgetLedger,
    HoldAsk,
    Refused,
    Reservation,
)
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.ratelimit.rate_limit_store import WindowState
from gateway.storage.redis_client import LeanRedis
from policies.budget_admission import fits_budget
from tests.policies import budget_cases, rate_limit_cases
from tests.policies.rate_limit_cases import T0, WINDOW_S
from tests.support.redis_ledger_time import let_ledger_time_pass

TENANT, MONTH = "acme", "month:2025-06"
TTL_S = 30.0


@dataclass(frozen=True)
class Replica:
    store: AdmissionStore
    ledger: BudgetLedger
    epochs: AuthEpochs


@pytest.fixture(params=["memory", "redis", "lean-redis"])
async def new_replica(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], Replica]]:
    if request.param == "memory":
        ledger, epochs = MemoryBudgetLedger(), MemoryAuthEpochs()
        replica = Replica(
            MemoryAdmissionStore(ledger, MemoryRateLimitStore(), epochs), ledger, epochs
        )
        yield lambda: replica
        return
    url: str = request.getfixturevalue("redis_url")
    clients: list[Redis | LeanRedis] = []

    def new_redis_replica() -> Replica:
        client = Redis.from_url(url) if request.param == "redis" else LeanRedis(url)
        clients.append(client)
        return Replica(
            RedisAdmissionStore(client), RedisBudgetLedger(client), RedisAuthEpochs(client)
        )

    yield new_redis_replica
    for client in clients:
        await client.aclose()


@pytest.fixture
async def replica(new_replica: Callable[[], Replica]) -> Replica:
    replica = new_replica()
    await replica.ledger.rebuild(TENANT, MONTH, 0)
    return replica


def ask(
    tokens: int = 10,
    *,
    epoch: str = INITIAL_EPOCH,
    rpm: int | None = None,
    tpm: int | None = None,
    limit: int | None = None,
    now: float | None = None,
) -> AdmissionAsk:
    budget = None if limit is None else BudgetAsk(MONTH, limit, TTL_S)
    now = time.time() if now is None else now
    return AdmissionAsk(TENANT, epoch, tokens, rpm, tpm, now, budget)


async def test_a_request_without_limits_counts_nothing(replica: Replica) -> None:
    assert await replica.store.admit(ask()) == Counted(window=None)


async def test_an_unknown_scoped_balance_is_named_and_nothing_is_counted(
    replica: Replica,
) -> None:
    """The end user's balance was never rebuilt: the step names it (index 2 of tenant, key,
    user) and holds nothing anywhere, not even in the balances it knows; rebuilt, it holds
    all three under one reservation."""
    key = BudgetAccount("key", "key-1", "micros")
    user = BudgetAccount("user", "alice", "tokens")
    await replica.ledger.rebuild(TENANT, MONTH, 0, key)
    more = (HoldAsk(key, MONTH, 1000, 70), HoldAsk(user, MONTH, 100, 40))
    request = AdmissionAsk(
        TENANT, INITIAL_EPOCH, 40, None, None, time.time(), BudgetAsk(MONTH, 100, TTL_S), more
    )
    assert await replica.store.admit(request) == BalanceUnknown(2)
    for account in (TENANT_TOKENS, key):
        assert await replica.ledger.balance(TENANT, MONTH, account) == Balance(0, 0)
    await replica.ledger.rebuild(TENANT, MONTH, 5, user)
    result = await replica.store.admit(request)
    assert isinstance(result, Counted)
    assert result.reservation is not None
    assert [(h.account, h.amount) for h in result.reservation.holds] == [
        (TENANT_TOKENS, 40),
        (key, 70),
        (user, 40),
    ]
    assert await replica.ledger.balance(TENANT, MONTH, user) == Balance(5, 40)
    await replica.ledger.settle(result.reservation, 30, 50)
    assert [await replica.ledger.balance(TENANT, MONTH, a) for a in (TENANT_TOKENS, key, user)] == [
        Balance(30, 0),
        Balance(50, 0),
        Balance(35, 0),
    ]


async def test_admits_rate_limit_and_budget_together(replica: Replica) -> None:
    result = await replica.store.admit(ask(40, rpm=5, tpm=1000, limit=100))
    assert isinstance(result, Counted)
    assert result.window is not None
    assert result.window.is_admitted
    assert (result.window.num_requests, result.window.num_tokens) == (1, 40)
    reservation = result.reservation
    assert reservation is not None
    assert result.balance is None
    assert (reservation.tenant_id, reservation.period_key, reservation.tokens) == (
        TENANT,
        MONTH,
        40,
    )
    assert reservation.expires_at == pytest.approx(time.time() + TTL_S, abs=5)
    assert await replica.ledger.balance(TENANT, MONTH) == Balance(used=0, reserved=40)
    # The ledger settles what the store reserved.
    await replica.ledger.settle(reservation, 25)
    assert await replica.ledger.balance(TENANT, MONTH) == Balance(used=25, reserved=0)


async def test_a_changed_epoch_counts_nothing_and_says_the_new_one(replica: Replica) -> None:
    await replica.epochs.bump(TENANT)
    epoch = await replica.epochs.current(TENANT)
    assert epoch != INITIAL_EPOCH
    assert await replica.store.admit(ask(rpm=1, limit=100)) == AuthChanged(epoch)
    assert await replica.ledger.balance(TENANT, MONTH) == Balance(used=0, reserved=0)
    # Nothing was counted: the one request rpm allows is still there.
    result = await replica.store.admit(ask(rpm=1, limit=100, epoch=epoch))
    assert isinstance(result, Counted)
    assert result.reservation is not None


async def test_every_bump_is_a_new_epoch(replica: Replica) -> None:
    seen = {await replica.epochs.current(TENANT)}
    for _ in range(5):
        await replica.epochs.bump(TENANT)
        seen.add(await replica.epochs.current(TENANT))
    assert len(seen) == 6
    assert await replica.epochs.current("other") == INITIAL_EPOCH


async def test_an_unknown_balance_counts_nothing_until_rebuilt(
    new_replica: Callable[[], Replica],
) -> None:
    replica = new_replica()
    assert await replica.store.admit(ask(rpm=1, limit=100)) == BalanceUnknown()
    assert await replica.ledger.rebuild(TENANT, MONTH, 95)
    result = await replica.store.admit(ask(5, rpm=1, limit=100))  # the rpm slot is still free
    assert isinstance(result, Counted)
    assert result.reservation is not None
    assert await replica.ledger.balance(TENANT, MONTH) == Balance(used=95, reserved=5)


async def test_a_rate_limit_refusal_reserves_nothing(replica: Replica) -> None:
    now = time.time()
    assert isinstance(await replica.store.admit(ask(rpm=1, limit=100, now=now)), Counted)
    result = await replica.store.admit(ask(rpm=1, limit=100, now=now + 1))
    assert isinstance(result, Counted)
    assert result.window is not None
    assert not result.window.is_admitted
    assert result.window.requests_fit_at == pytest.approx(now + 60, abs=0.01)
    assert result.reservation is None
    assert result.balance is None
    assert await replica.ledger.balance(TENANT, MONTH) == Balance(used=0, reserved=10)


async def test_a_budget_refusal_says_the_balance_and_keeps_the_hit(replica: Replica) -> None:
    assert isinstance(await replica.store.admit(ask(60, limit=100)), Counted)
    result = await replica.store.admit(ask(41, tpm=1000, limit=100))
    assert isinstance(result, Counted)
    assert result.reservation is None
    assert result.balance == Balance(used=0, reserved=60)
    assert result.window is not None
    assert result.window.is_admitted
    exact = await replica.store.admit(ask(40, tpm=1000, limit=100))
    assert isinstance(exact, Counted)
    assert exact.reservation is not None
    assert exact.window is not None
    assert exact.window.num_tokens == 81


async def test_tenants_have_separate_windows(replica: Replica) -> None:
    now = time.time()
    assert isinstance(await replica.store.admit(ask(10, rpm=1, tpm=10, now=now)), Counted)
    other = AdmissionAsk("other", INITIAL_EPOCH, 10, 1, 10, now, None)
    result = await replica.store.admit(other)
    assert isinstance(result, Counted)
    assert result.window is not None
    assert result.window.is_admitted
    assert result.window.num_tokens == 10


async def test_concurrent_hits_on_two_replicas_stay_within_the_rate_limits(
    new_replica: Callable[[], Replica],
) -> None:
    replicas = [new_replica(), new_replica()]
    turns = itertools.count()
    now = time.time()

    async def hit(
        tenant_id: str,
        tokens: int,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        at: float = now,
    ) -> WindowState:
        request = AdmissionAsk(tenant_id, INITIAL_EPOCH, tokens, rpm, tpm, at, None)
        result = await replicas[next(turns) % 2].store.admit(request)
        assert isinstance(result, Counted)
        assert result.window is not None
        return result.window

    by_requests = await asyncio.gather(*(hit("r", 7, rpm=50) for _ in range(200)))
    by_tokens = await asyncio.gather(*(hit("t", 10, tpm=1000) for _ in range(200)))
    assert sum(w.is_admitted for w in by_requests) == 50
    assert sum(w.is_admitted for w in by_tokens) == 100
    final_r = await hit("r", 7, rpm=50, at=now + 1)
    final_t = await hit("t", 1, tpm=1000, at=now + 1)
    assert (final_r.is_admitted, final_r.num_requests, final_r.num_tokens) == (False, 50, 350)
    assert (final_t.is_admitted, final_t.num_requests, final_t.num_tokens) == (False, 100, 1000)


async def test_bad_arguments_are_refused(replica: Replica) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        await replica.store.admit(ask(0, limit=100))
    with pytest.raises(ValueError, match="rpm_limit must be >= 0"):
        await replica.store.admit(ask(rpm=-1))


async def test_200_concurrent_requests_on_two_replicas_stay_within_budget(
    new_replica: Callable[[], Replica],
) -> None:
    replicas = [new_replica(), new_replica()]
    await replicas[0].ledger.rebuild(TENANT, MONTH, 0)
    limit, tokens = 1000, 30
    results = await asyncio.gather(
        *(replicas[n % 2].store.admit(ask(tokens, rpm=10_000, limit=limit)) for n in range(200))
    )
    reservations = [r.reservation for r in results if isinstance(r, Counted) and r.reservation]
    assert len(reservations) == limit // tokens
    assert await replicas[1].ledger.balance(TENANT, MONTH) == Balance(
        used=0, reserved=len(reservations) * tokens
    )
    await asyncio.gather(*(replicas[n % 2].ledger.settle(r, 1) for n, r in enumerate(reservations)))
    assert await replicas[0].ledger.balance(TENANT, MONTH) == Balance(
        used=len(reservations), reserved=0
    )


# -- the tables of cases (tests/policies/budget_cases.py, rate_limit_cases.py) --------------
# The gateway reserves budget and hits rate limits through this step, not through the
# ledger's and store's own calls, so both tables run here too.


@dataclass(frozen=True)
class TableReplica:
    store: AdmissionStore
    ledger: BudgetLedger
    advance: Callable[[float], Awaitable[None]]


@pytest.fixture
async def new_table_replica(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[float], TableReplica]]:
    """``new(retention_s)``: a fresh admission step and ledger (budget retention as given),
    in process on a clock the test moves, or on Redis with a new client (server time)."""
    clients: list[Redis | LeanRedis] = []

    if request.param == "memory":
        clock = [T0]

        def now() -> float:
            return clock[0]

        async def advance_clock(seconds: float) -> None:
            clock[0] += seconds

        def new_memory(retention_s: float) -> TableReplica:
            ledger = MemoryBudgetLedger(clock=now, settled_retention_s=retention_s)
            rate_limits = MemoryRateLimitStore(window_s=WINDOW_S)
            store = MemoryAdmissionStore(ledger, rate_limits, MemoryAuthEpochs())
            return TableReplica(store, ledger, advance_clock)

        yield new_memory
        return
    url: str = request.getfixturevalue("redis_url")

    def new_redis(retention_s: float) -> TableReplica:
        client = Redis.from_url(url) if request.param == "redis" else LeanRedis(url)
        clients.append(client)
        store = RedisAdmissionStore(client, window_s=WINDOW_S)
        advance = partial(let_ledger_time_pass, client)  # Redis keeps the time: see there
        return TableReplica(store, RedisBudgetLedger(client, retention_s), advance)

    yield new_redis
    for client in clients:
        await client.aclose()


def _kinds_for(targets: frozenset[str]) -> list[str]:
    """The replica kinds a budget case runs on: the admission step, where its ledger runs."""
    if "admission" not in targets:
        return []
    kinds = ["memory"] if "memory" in targets else []
    return kinds + (["redis", "lean-redis"] if "redis" in targets else [])


KINDS = ["memory", "redis", "lean-redis"]


@pytest.mark.parametrize(
    ("new_table_replica", "case"),
    [
        pytest.param(kind, case, id=f"{kind}-{budget_cases.case_id(case)}")
        for case in budget_cases.BUDGET_CASES
        for kind in _kinds_for(case.targets)
    ],
    indirect=["new_table_replica"],
)
async def test_budget_cases_through_the_admission_step(
    new_table_replica: Callable[[float], TableReplica], case: budget_cases.BudgetCase
) -> None:
    replica = new_table_replica(case.retention_s)

    async def reserve(period_key: str, limit: int, tokens: int, ttl_s: float) -> Reservation | None:
        budget = BudgetAsk(period_key, limit, ttl_s)
        ask = AdmissionAsk(budget_cases.TENANT, INITIAL_EPOCH, tokens, None, None, T0, budget)
        result = await replica.store.admit(ask)
        if isinstance(result, BalanceUnknown):  # a new period: the gateway rebuilds it
            await replica.ledger.rebuild(budget_cases.TENANT, period_key, 0)
            result = await replica.store.admit(ask)
        assert isinstance(result, Counted)
        assert result.window is None
        if result.reservation is None:  # the balance it refused on refuses under the policy
            balance = result.balance
            assert balance is not None
            assert balance == await replica.ledger.balance(budget_cases.TENANT, period_key)
            assert not fits_budget(
                used=balance.used, reserved=balance.reserved, request_tokens=tokens, limit=limit
            )
        return result.reservation

    await budget_cases.run_on_ledger(case, replica.ledger, replica.advance, reserve)


@pytest.mark.parametrize(
    ("new_table_replica", "case"),
    [
        pytest.param(kind, case, id=f"{kind}-{budget_cases.scoped_case_id(case)}")
        for case in budget_cases.SCOPED_CASES
        for kind in KINDS
    ],
    indirect=["new_table_replica"],
)
async def test_scoped_budget_cases_through_the_admission_step(
    new_table_replica: Callable[[float], TableReplica], case: budget_cases.ScopedCase
) -> None:
    """Budgets at three levels through the gateway's own step: the tenant's token budget as
    ``budget`` (where the case has one), every other as ``more_budgets``, in one call."""
    replica = new_table_replica(3600.0)

    async def reserve_all(asks: list[HoldAsk], ttl_s: float) -> Reservation | Refused:
        first = asks[0]
        has_tenant_tokens = first.account == TENANT_TOKENS
        budget = BudgetAsk(first.period_key, first.limit, ttl_s) if has_tenant_tokens else None
        more = tuple(asks[1:] if has_tenant_tokens else asks)
        tokens = first.amount if has_tenant_tokens else 1
        ask = AdmissionAsk(
            budget_cases.TENANT, INITIAL_EPOCH, tokens, None, None, T0, budget, more, ttl_s
        )
        result = await replica.store.admit(ask)
        assert isinstance(result, Counted)
        if result.reservation is not None:
            return result.reservation
        assert result.balance is not None
        index = result.refused_by if has_tenant_tokens else result.refused_by - 1
        return Refused(index, result.balance)

    await budget_cases.run_scoped_on_ledger(case, replica.ledger, reserve_all)


@pytest.mark.parametrize(
    ("new_table_replica", "case"),
    [
        pytest.param(kind, case, id=f"{kind}-{rate_limit_cases.case_id(case)}")
        for case in rate_limit_cases.cases_for("admission")
        for kind in KINDS
    ],
    indirect=["new_table_replica"],
)
async def test_rate_limit_cases_through_the_admission_step(
    new_table_replica: Callable[[float], TableReplica], case: rate_limit_cases.RateLimitCase
) -> None:
    replica = new_table_replica(3600.0)
    for hit in case.hits:
        rpm, tpm = case.limits_of(hit)
        now = T0 + hit.at
        ask = AdmissionAsk(rate_limit_cases.TENANT, INITIAL_EPOCH, hit.tokens, rpm, tpm, now, None)
        result = await replica.store.admit(ask)
        if rpm is None and tpm is None:  # no window is consulted: admitted, nothing counted
            assert hit.is_admitted
            assert result == Counted(window=None)
            continue
        assert isinstance(result, Counted)
        assert result.window is not None
        assert result.reservation is None
        assert result.balance is None
        rate_limit_cases.check_hit(case, hit, result.window)
