"""One suite, run against both ledgers: in-process, and Redis on a real redis-server (through
redis-py and through the gateway's lean client, ``LeanRedis``).

The rule itself (balance, reservation, settle, release, expiry, period rollover, over-limit)
is the table of cases in ``tests/policies/budget_cases.py``, which also runs against the pure
policy; the other tests here check what a table of single-tenant steps cannot: several
gateways on one store, concurrency, memory held, rebuilds, keys and bad arguments."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from gateway.ledger.budget_ledger import (
    DEFAULT_SETTLED_RETENTION_S,
    Balance,
    BudgetLedger,
    Reservation,
)
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.storage.redis_client import LeanRedis
from tests.policies.budget_cases import (
    BUDGET_CASES,
    SCOPED_CASES,
    BudgetCase,
    ScopedCase,
    Target,
    case_id,
    run_on_ledger,
    run_scoped_on_ledger,
    scoped_case_id,
)
from tests.support.redis_ledger_time import let_ledger_time_pass

TENANT, DAY = "acme", "day:2025-06-01"
TTL_S = 30.0
MS = 0.001  # Redis keeps expiries in whole milliseconds


@dataclass
class Ledgers:
    """``new()`` is one more gateway on the same store (memory: there is only one);
    ``with_retention(s)`` a fresh ledger that remembers lapsed reservations for ``s``."""

    new: Callable[[], BudgetLedger]
    with_retention: Callable[[float], BudgetLedger]
    advance: Callable[[float], Awaitable[None]]  # let this much ledger time pass
    num_held: Callable[[], Awaitable[int]]  # entries kept beside the balances themselves


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_750_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis", "lean-redis"])
async def ledgers(request: pytest.FixtureRequest) -> AsyncIterator[Ledgers]:
    if request.param == "memory":
        clock = FakeClock()
        ledger = MemoryBudgetLedger(clock=clock)

        async def advance_clock(seconds: float) -> None:
            clock.now += seconds

        async def num_held_in_memory() -> int:
            accounts = ledger._accounts.values()  # every container an account keeps
            return sum(len(v) for a in accounts for v in vars(a).values() if hasattr(v, "__len__"))

        def memory_with_retention(retention_s: float) -> BudgetLedger:
            return MemoryBudgetLedger(clock=clock, settled_retention_s=retention_s)

        yield Ledgers(
            new=lambda: ledger,
            with_retention=memory_with_retention,
            advance=advance_clock,
            num_held=num_held_in_memory,
        )
        return
    url: str = request.getfixturevalue("redis_url")
    clients: list[Redis | LeanRedis] = []

    def new_redis_ledger(retention_s: float = DEFAULT_SETTLED_RETENTION_S) -> BudgetLedger:
        if request.param == "redis":
            clients.append(Redis.from_url(url))
        else:
            # What is tested is the budget, not Redis's latency: 200 requests opening
            # connections at once on a busy CI machine have taken longer than the 0.5 s a
            # production gateway allows for a connection.
            clients.append(LeanRedis(url, connect_timeout_s=5.0, timeout_s=5.0))
        return RedisBudgetLedger(clients[-1], settled_retention_s=retention_s)

    async def num_held_in_redis() -> int:
        """Members of every budget key but the balances' own hashes."""
        client = Redis.from_url(url)
        try:
            total = 0
            async for key in client.scan_iter(match="tollway:budget:*"):
                kind = (await client.type(key)).decode()
                if kind == "zset":
                    total += await client.zcard(key)
                elif kind == "hash" and key.endswith(b":reservation_tokens"):
                    total += await client.hlen(key)
            return total
        finally:
            await client.aclose()

    clock_hand = LeanRedis(url)  # Redis keeps the time: the ledger's instants move instead
    clients.append(clock_hand)
    yield Ledgers(
        new=new_redis_ledger,
        with_retention=new_redis_ledger,
        advance=lambda seconds: let_ledger_time_pass(clock_hand, seconds),
        num_held=num_held_in_redis,
    )
    for client in clients:
        await client.aclose()


@pytest.fixture
def ledger(ledgers: Ledgers) -> BudgetLedger:
    return ledgers.new()


async def reserve(ledger: BudgetLedger, tokens: int, limit: int = 100) -> Reservation | None:
    return await ledger.reserve(TENANT, DAY, limit, tokens, TTL_S)


# -- the table of cases (tests/policies/budget_cases.py) ------------------------------------


def _ledger_target(kind: str) -> Target:
    return "memory" if kind == "memory" else "redis"


@pytest.mark.parametrize(
    ("ledgers", "case"),
    [
        pytest.param(kind, case, id=f"{kind}-{case_id(case)}")
        for case in BUDGET_CASES
        for kind in ("memory", "redis", "lean-redis")
        if _ledger_target(kind) in case.targets
    ],
    indirect=["ledgers"],
)
async def test_budget_cases(ledgers: Ledgers, case: BudgetCase) -> None:
    await run_on_ledger(case, ledgers.with_retention(case.retention_s), ledgers.advance)


@pytest.mark.parametrize("case", SCOPED_CASES, ids=scoped_case_id)
async def test_scoped_budget_cases(ledgers: Ledgers, case: ScopedCase) -> None:
    await run_scoped_on_ledger(case, ledgers.new())


async def test_finished_reservations_leave_nothing_behind(ledgers: Ledgers) -> None:
    """What a ledger holds follows the requests in flight, not the requests served: a
    gateway's memory (or Redis's) must not grow with every request it has answered."""
    ledger = ledgers.new()
    for n in range(1, 301):
        held = [await reserve(ledger, 1, limit=10**6) for _ in range(3)]
        assert all(held)
        for reservation in held[:2]:
            assert reservation is not None
            await ledger.settle(reservation, 1)
        assert held[2] is not None
        await ledger.release(held[2])
        if n in (150, 300):
            assert await ledgers.num_held() == 0
    assert await ledger.balance(TENANT, DAY) == Balance(used=600, reserved=0)


async def test_many_requests_in_flight_hold_entries_in_proportion(ledgers: Ledgers) -> None:
    ledger = ledgers.new()
    in_flight = [await reserve(ledger, 1, limit=10**6) for _ in range(10)]
    for _ in range(500):  # one finishes, one arrives: always ten in flight
        finished = in_flight.pop(0)
        assert finished is not None
        await ledger.settle(finished, 1)
        in_flight.append(await reserve(ledger, 1, limit=10**6))
    # Each live reservation costs a few entries (Redis: its expiry and its tokens; memory:
    # those and its place in the expiry heap, rebuilt once stale entries pile up).
    assert await ledgers.num_held() <= 3 * 10 + 64 + 2
    assert await ledger.balance(TENANT, DAY) == Balance(used=500, reserved=10)


async def test_settle_through_another_gateway(ledgers: Ledgers) -> None:
    reservation = await reserve(ledgers.new(), 100)
    assert reservation is not None
    other = ledgers.new()
    await other.settle(reservation, 60)
    await other.settle(reservation, 60)
    assert await ledgers.new().balance(TENANT, DAY) == Balance(used=60, reserved=0)


async def test_expires_at_is_ttl_after_reserving(ledgers: Ledgers) -> None:
    ledger = ledgers.new()
    started = time.monotonic()
    first = await ledger.reserve(TENANT, DAY, 100, 10, ttl_s=10.0)
    second = await ledger.reserve(TENANT, DAY, 100, 10, ttl_s=20.0)
    between = time.monotonic() - started  # Redis: its clock moves on between the two
    assert first is not None
    assert second is not None
    assert first.reservation_id != second.reservation_id
    assert 10.0 - MS <= second.expires_at - first.expires_at <= 10.0 + between + MS


async def test_rebuild_sets_used_only_while_unknown(ledger: BudgetLedger) -> None:
    assert not await ledger.is_known(TENANT, DAY)
    assert await ledger.rebuild(TENANT, DAY, 500)
    assert await ledger.is_known(TENANT, DAY)
    assert not await ledger.rebuild(TENANT, DAY, 10)
    assert await ledger.balance(TENANT, DAY) == Balance(used=500, reserved=0)
    assert await reserve(ledger, 101, limit=600) is None
    assert await reserve(ledger, 100, limit=600) is not None


async def test_rebuild_takes_the_usage_records_over_usage_settled_while_unknown(
    ledger: BudgetLedger,
) -> None:
    reservation = await reserve(ledger, 20)
    assert reservation is not None
    await ledger.settle(reservation, 20)
    assert not await ledger.is_known(TENANT, DAY)
    assert await ledger.rebuild(TENANT, DAY, 520)  # the records include those 20 tokens
    assert await ledger.balance(TENANT, DAY) == Balance(used=520, reserved=0)


async def test_balances_are_per_tenant_and_period(ledger: BudgetLedger) -> None:
    assert await ledger.reserve("a:b", "c", 10, 10, TTL_S) is not None
    assert await ledger.reserve("a", "b:c", 10, 10, TTL_S) is not None
    assert await ledger.reserve("a:b", "d", 10, 10, TTL_S) is not None
    assert await ledger.reserve("a:b", "c", 10, 1, TTL_S) is None
    assert await ledger.balance("{x}", "c") == Balance(used=0, reserved=0)
    assert not await ledger.is_known("a", "b:c")


@pytest.mark.parametrize(
    ("limit", "tokens", "ttl_s", "message"),
    [
        (-1, 1, 1.0, "budget limit must be >= 0"),
        (10, 0, 1.0, "at least one token"),
        (10, 1, 0.0, "ttl_s must be > 0"),
    ],
)
async def test_reserve_rejects_bad_arguments(
    ledger: BudgetLedger, limit: int, tokens: int, ttl_s: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await ledger.reserve(TENANT, DAY, limit, tokens, ttl_s)


async def test_settle_rejects_negative_usage(ledger: BudgetLedger) -> None:
    reservation = await reserve(ledger, 10)
    assert reservation is not None
    with pytest.raises(ValueError, match="used_tokens"):
        await ledger.settle(reservation, -1)


async def test_200_concurrent_requests_through_two_gateways_stay_within_budget(
    ledgers: Ledgers,
) -> None:
    gateways = [ledgers.new(), ledgers.new()]
    limit, max_tokens = 10_000, 100
    rng = random.Random(7)
    # Each request uses at least 60 tokens, so 200 of them cannot all fit in 10,000.
    plans = [(rng.uniform(0, 0.01), rng.randint(60, max_tokens)) for _ in range(200)]

    async def one_request(index: int) -> int | None:
        ledger = gateways[index % 2]
        reservation = await ledger.reserve(TENANT, DAY, limit, max_tokens, TTL_S)
        if reservation is None:
            return None
        delay, used = plans[index]
        await asyncio.sleep(delay)  # the engine at work
        await ledger.settle(reservation, used)
        return used

    results = await asyncio.gather(*(one_request(i) for i in range(200)))
    settled = [used for used in results if used is not None]
    assert len(settled) >= limit // max_tokens
    assert len(settled) < 200
    assert sum(settled) <= limit
    balance = await gateways[0].balance(TENANT, DAY)
    assert balance == Balance(used=sum(settled), reserved=0)

    # Once everything has settled, every request that fits is admitted, concurrently too.
    remaining = limit - balance.used
    num_requests = min(200, remaining)
    share = remaining // num_requests if num_requests else 0
    second_wave = await asyncio.gather(
        *(gateways[i % 2].reserve(TENANT, DAY, limit, share, TTL_S) for i in range(num_requests))
    )
    assert all(reservation is not None for reservation in second_wave)
    left = remaining - num_requests * share
    assert await gateways[1].reserve(TENANT, DAY, limit, left + 1, TTL_S) is None
    if left:
        assert await gateways[1].reserve(TENANT, DAY, limit, left, TTL_S) is not None
    assert await gateways[0].balance(TENANT, DAY) == Balance(used=balance.used, reserved=remaining)
