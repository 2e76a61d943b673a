"""One suite, run against both admission stores: in-process, and Redis on a real redis-server
(through redis-py and through the gateway's lean client, ``LeanRedis``).

Each "replica" is a store with the budget ledger and auth epochs it shares state with (memory:
one process, so one of each; Redis: a new client per replica, as separate gateways have).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from gateway.admission.atomic_step import (
    AdmissionAsk,
    AdmissionStore,
    AuthChanged,
    BalanceUnknown,
    BudgetAsk,
    Counted,
)
from gateway.admission.memory_atomic_step import MemoryAdmissionStore
from gateway.admission.redis_atomic_step import RedisAdmissionStore
from gateway.auth.epochs import INITIAL_EPOCH, AuthEpochs, MemoryAuthEpochs, RedisAuthEpochs
from gateway.ledger.budget_ledger import Balance, BudgetLedger
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.storage.redis_client import LeanRedis

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


async def test_admits_rate_limit_and_budget_together(replica: Replica) -> None:
    result = await replica.store.admit(ask(40, rpm=5, tpm=1000, limit=100))
    assert isinstance(result, Counted)
    assert result.window is not None and result.window.is_admitted
    assert (result.window.num_requests, result.window.num_tokens) == (1, 40)
    reservation = result.reservation
    assert reservation is not None and result.balance is None
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
    assert isinstance(result, Counted) and result.reservation is not None


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
    assert isinstance(result, Counted) and result.reservation is not None
    assert await replica.ledger.balance(TENANT, MONTH) == Balance(used=95, reserved=5)


async def test_a_rate_limit_refusal_reserves_nothing(replica: Replica) -> None:
    now = time.time()
    assert isinstance(await replica.store.admit(ask(rpm=1, limit=100, now=now)), Counted)
    result = await replica.store.admit(ask(rpm=1, limit=100, now=now + 1))
    assert isinstance(result, Counted)
    assert result.window is not None and not result.window.is_admitted
    assert result.window.requests_fit_at == pytest.approx(now + 60, abs=0.01)
    assert result.reservation is None and result.balance is None
    assert await replica.ledger.balance(TENANT, MONTH) == Balance(used=0, reserved=10)


async def test_a_budget_refusal_says_the_balance_and_keeps_the_hit(replica: Replica) -> None:
    assert isinstance(await replica.store.admit(ask(60, limit=100)), Counted)
    result = await replica.store.admit(ask(41, tpm=1000, limit=100))
    assert isinstance(result, Counted)
    assert result.reservation is None
    assert result.balance == Balance(used=0, reserved=60)
    assert result.window is not None and result.window.is_admitted  # as before: it counts
    exact = await replica.store.admit(ask(40, tpm=1000, limit=100))
    assert isinstance(exact, Counted) and exact.reservation is not None
    assert exact.window is not None and exact.window.num_tokens == 81


async def test_bad_arguments_are_refused(replica: Replica) -> None:
    with pytest.raises(ValueError):
        await replica.store.admit(ask(0, limit=100))
    with pytest.raises(ValueError):
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
