"""What only the Redis ledger has: the ``reserved`` field kept beside ``used``, which must always
equal the sum of the live reservations (the shared suite is ``test_budget_ledger``)."""

from __future__ import annotations

import random

from gateway.ledger.budget_ledger import Balance, Reservation
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ledger.redis_ledger import BudgetKeys, RedisBudgetLedger
from gateway.storage.redis_client import LeanRedis
from tests.support.redis_ledger_time import let_ledger_time_pass

TENANT, DAY = "acme", "day:2025-06-01"
TTL_S = 30.0


async def test_reserved_follows_every_operation_as_the_memory_ledger_does(redis_url: str) -> None:
    client = LeanRedis(redis_url)
    redis_ledger, memory_ledger = RedisBudgetLedger(client), MemoryBudgetLedger()
    rng = random.Random(3)
    held: list[tuple[Reservation, Reservation]] = []
    try:
        for _ in range(400):
            action = rng.random()
            if action < 0.5 or not held:
                tokens = rng.randint(1, 400)
                pair = (
                    await redis_ledger.reserve(TENANT, DAY, 20_000, tokens, TTL_S),
                    await memory_ledger.reserve(TENANT, DAY, 20_000, tokens, TTL_S),
                )
                assert (pair[0] is None) == (pair[1] is None)
                if pair[0] is not None and pair[1] is not None:
                    held.append((pair[0], pair[1]))
            else:
                in_redis, in_memory = held.pop(rng.randrange(len(held)))
                if action < 0.8:
                    used = rng.randint(0, 400)
                    for _ in range(rng.choice((1, 2))):  # settling twice changes nothing
                        await redis_ledger.settle(in_redis, used)
                        await memory_ledger.settle(in_memory, used)
                else:
                    await redis_ledger.release(in_redis)
                    await memory_ledger.release(in_memory)
            expected = await memory_ledger.balance(TENANT, DAY)
            assert await redis_ledger.balance(TENANT, DAY) == expected
        assert expected.reserved == sum(r.tokens for r, _ in held)
    finally:
        await client.aclose()


async def test_a_balance_from_before_the_reserved_field_is_summed_once(redis_url: str) -> None:
    client = LeanRedis(redis_url)
    ledger = RedisBudgetLedger(client)
    try:
        first = await ledger.reserve(TENANT, DAY, 1_000, 300, TTL_S)
        second = await ledger.reserve(TENANT, DAY, 1_000, 200, TTL_S)
        assert first is not None
        assert second is not None
        # As an older gateway left it: reservation_tokens filled, no `reserved` field.
        await client.execute_command("HDEL", BudgetKeys.of(TENANT, DAY).account, "reserved")
        assert await ledger.balance(TENANT, DAY) == Balance(used=0, reserved=500)
        assert await ledger.reserve(TENANT, DAY, 1_000, 501, TTL_S) is None
        await ledger.settle(first, 100)
        assert await ledger.balance(TENANT, DAY) == Balance(used=100, reserved=200)
        assert await ledger.reserve(TENANT, DAY, 1_000, 700, TTL_S) is not None
    finally:
        await client.aclose()


async def test_reading_a_balance_that_holds_nothing_writes_nothing(redis_url: str) -> None:
    client = LeanRedis(redis_url)
    ledger = RedisBudgetLedger(client)
    try:
        assert await ledger.balance(TENANT, DAY) == Balance(used=0, reserved=0)
        assert await client.execute_command("EXISTS", *BudgetKeys.of(TENANT, DAY).as_list()) == 0
    finally:
        await client.aclose()


async def test_many_expired_reservations_are_purged_at_once(redis_url: str) -> None:
    """More expired reservations than one Lua ``unpack`` takes (a gateway that died busy)."""
    client = LeanRedis(redis_url)
    ledger = RedisBudgetLedger(client)
    keys = BudgetKeys.of(TENANT, DAY)
    try:
        assert await ledger.reserve(TENANT, DAY, 10**9, 5, TTL_S) is not None
        stale = [f"stale-{i}" for i in range(5_000)]
        await client.execute_command(
            "ZADD", keys.reservations, *(x for rid in stale for x in (1, rid))
        )
        await client.execute_command(
            "HSET", keys.reservation_tokens, *(x for rid in stale for x in (rid, 2))
        )
        await client.execute_command("HINCRBY", keys.account, "reserved", 2 * len(stale))
        assert await ledger.balance(TENANT, DAY) == Balance(used=0, reserved=5)
        assert await client.execute_command("HLEN", keys.reservation_tokens) == 1
    finally:
        await client.aclose()


async def test_a_lapsed_reservation_counts_once_then_is_forgotten(redis_url: str) -> None:
    """An expired reservation is remembered for the retention period (its late settle
    counts, once), then forgotten: no key keeps it."""
    client = LeanRedis(redis_url)
    ledger = RedisBudgetLedger(client, settled_retention_s=600)
    keys = BudgetKeys.of(TENANT, DAY)
    try:
        late = await ledger.reserve(TENANT, DAY, 1_000, 10, ttl_s=TTL_S)
        lost = await ledger.reserve(TENANT, DAY, 1_000, 10, ttl_s=TTL_S)
        assert late is not None
        assert lost is not None
        await let_ledger_time_pass(client, TTL_S)
        assert await ledger.balance(TENANT, DAY) == Balance(used=0, reserved=0)
        assert await client.execute_command("ZCARD", keys.lapsed) == 2
        await ledger.settle(late, 7)
        await ledger.settle(late, 7)
        assert await ledger.balance(TENANT, DAY) == Balance(used=7, reserved=0)
        await let_ledger_time_pass(client, 600)
        await ledger.settle(lost, 5)  # past the retention: forgotten, a no-op
        assert await ledger.balance(TENANT, DAY) == Balance(used=7, reserved=0)
        assert await client.execute_command("EXISTS", keys.lapsed) == 0
    finally:
        await client.aclose()
