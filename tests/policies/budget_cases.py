"""The budget rule as one table of cases, run against every implementation of it.

The rule lives in three places: the pure policy (``policies/budget_admission.py``), the
in-process ledger (``gateway/ledger/memory_ledger.py``) and the Lua of the Redis ledger
(``gateway/ledger/redis_ledger.py``). Each `BudgetCase` is a starting balance, a sequence of
operations, and the balance expected after each one; `Reserve` steps also name the decision.
The targets (a case lists those it runs against in ``targets``):

- ``policy`` (``tests/policies/test_budget_admission.py``): every `Reserve` decision must be
  ``admit_budget``'s over the balance the table expects just before it. The policy keeps no
  balance, so settle, release and expiry only matter to it through those balances.
- ``memory`` and ``redis`` (``tests/gateway/ledger/test_budget_ledger.py``): the ledger runs
  every step (`run_on_ledger`); its decisions and balances must be the table's. Redis keeps
  time on the server, where `Advance` moves the instants the ledger keeps back instead
  (``tests/support/redis_ledger_time.py``) while real time passes as well: durations here are
  a minute or more, which a busy machine's milliseconds never change, and a case that needs
  an exact instant (``EXACT_TIME``) does not run on Redis.
- ``admission`` (``tests/gateway/admission/test_admission_store.py``): the same, but reserving
  through the admission step, the gateway's own path (its Redis script is not the ledger's
  ``reserve`` script); it runs on memory and Redis as the case's other targets say.

A case's clock starts at ``start``; the balance the table speaks of is that of the budget
window (``policies/budget_period.py``) in force on that clock, the period key the gateway
would pass. `Advance` moves the case's clock and the ledger's together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Literal

from gateway.ledger.budget_ledger import Balance, BudgetLedger, Reservation
from policies.budget_period import budget_window
from policies.quota import BudgetPeriod

Target = Literal["policy", "memory", "redis", "admission"]
ALL: frozenset[Target] = frozenset({"policy", "memory", "redis", "admission"})
EXACT_TIME: frozenset[Target] = ALL - {"redis"}  # Redis time also moves on by itself
POLICY_ONLY: frozenset[Target] = frozenset({"policy"})  # the ledgers take an int limit

TTL_S = 30.0
NOON = datetime(2025, 6, 1, 12, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Reserve:
    """Reserve ``tokens``; ``name`` lets later steps settle or release it."""

    name: str
    tokens: int
    is_admitted: bool
    ttl_s: float = TTL_S


@dataclass(frozen=True)
class Settle:
    name: str
    used_tokens: int


@dataclass(frozen=True)
class Release:
    name: str


@dataclass(frozen=True)
class Advance:
    """Let ``seconds`` pass on the case's clock and the ledger's."""

    seconds: float


Step = Reserve | Settle | Release | Advance


@dataclass(frozen=True)
class BudgetCase:
    """``steps``: each operation and the balance (of the window in force) right after it."""

    name: str
    limit: int | None
    steps: tuple[tuple[Step, Balance], ...]
    used: int = 0  # settled before the first step (a rebuilt balance)
    period: BudgetPeriod = "day"
    start: datetime = NOON
    retention_s: float = 3600.0  # how long an expired reservation's late settle still counts
    targets: frozenset[Target] = field(default=ALL)
    # Balances by period key once every step has run (windows other than the last one's)
    ends_with: tuple[tuple[str, Balance], ...] = ()

    @property
    def start_balance(self) -> Balance:
        return Balance(used=self.used, reserved=0)


def _b(used: int, reserved: int) -> Balance:
    return Balance(used=used, reserved=reserved)


BUDGET_CASES: tuple[BudgetCase, ...] = (
    BudgetCase(
        "a reservation counts against the balance until the limit",
        limit=100,
        steps=(
            (Reserve("a", 60, True), _b(0, 60)),
            (Reserve("b", 40, True), _b(0, 100)),  # exactly at the limit: admitted
            (Reserve("c", 1, False), _b(0, 100)),  # one over: refused
        ),
    ),
    BudgetCase(
        "used and reserved both count",
        limit=1000,
        used=600,
        steps=(
            (Reserve("a", 300, True), _b(600, 300)),
            (Reserve("b", 101, False), _b(600, 300)),
            (Reserve("c", 100, True), _b(600, 400)),
        ),
    ),
    BudgetCase(
        "a request larger than the whole budget is refused and holds nothing",
        limit=100,
        steps=(
            (Reserve("a", 101, False), _b(0, 0)),
            (Reserve("b", 100, True), _b(0, 100)),
        ),
    ),
    BudgetCase(
        "a spent budget refuses everything",
        limit=500,
        used=500,
        steps=((Reserve("a", 1, False), _b(500, 0)),),
    ),
    BudgetCase(
        "a budget overspent by settlements refuses everything",
        limit=100,
        steps=(
            (Reserve("a", 50, True), _b(0, 50)),
            (Settle("a", 130), _b(130, 0)),  # the engine used more than reserved: it counts
            (Reserve("b", 1, False), _b(130, 0)),
        ),
    ),
    BudgetCase(
        "settling below the reservation frees the rest",
        limit=100,
        steps=(
            (Reserve("a", 100, True), _b(0, 100)),
            (Settle("a", 30), _b(30, 0)),
            (Reserve("b", 71, False), _b(30, 0)),
            (Reserve("c", 70, True), _b(30, 70)),
        ),
    ),
    BudgetCase(
        "settle twice: the first settle wins, later ones and a release are no-ops",
        limit=100,
        steps=(
            (Reserve("a", 50, True), _b(0, 50)),
            (Settle("a", 40), _b(40, 0)),
            (Settle("a", 40), _b(40, 0)),
            (Settle("a", 7), _b(40, 0)),
            (Release("a"), _b(40, 0)),
            (Reserve("b", 60, True), _b(40, 60)),
        ),
    ),
    BudgetCase(
        "release frees the reservation without usage; a settle after it is a no-op",
        limit=100,
        steps=(
            (Reserve("a", 100, True), _b(0, 100)),
            (Release("a"), _b(0, 0)),
            (Settle("a", 100), _b(0, 0)),
            (Release("a"), _b(0, 0)),
            (Reserve("b", 100, True), _b(0, 100)),
        ),
    ),
    BudgetCase(
        "settling zero tokens finishes the reservation",
        limit=100,
        steps=(
            (Reserve("a", 100, True), _b(0, 100)),
            (Settle("a", 0), _b(0, 0)),
            (Settle("a", 50), _b(0, 0)),
        ),
    ),
    BudgetCase(
        "an expired reservation stops counting; its late settle counts once",
        limit=100,
        steps=(
            (Reserve("a", 100, True, ttl_s=60.0), _b(0, 100)),
            (Reserve("b", 1, False), _b(0, 100)),
            (Advance(90.0), _b(0, 0)),
            (Reserve("c", 100, True), _b(0, 100)),
            (Settle("a", 25), _b(25, 100)),  # the engine did consume them
            (Settle("a", 25), _b(25, 100)),
            (Release("a"), _b(25, 100)),
        ),
    ),
    BudgetCase(
        "a release after expiry frees nothing more",
        limit=100,
        steps=(
            (Reserve("a", 60, True, ttl_s=60.0), _b(0, 60)),
            (Advance(90.0), _b(0, 0)),
            (Release("a"), _b(0, 0)),
            (Settle("a", 60), _b(0, 0)),  # released: finished
        ),
    ),
    BudgetCase(
        "a lapsed reservation is forgotten after the retention period",
        limit=100,
        retention_s=600.0,
        steps=(
            (Reserve("late", 10, True, ttl_s=60.0), _b(0, 10)),
            (Reserve("lost", 10, True, ttl_s=60.0), _b(0, 20)),
            (Advance(90.0), _b(0, 0)),
            (Settle("late", 7), _b(7, 0)),
            (Advance(600.0), _b(7, 0)),
            (Settle("lost", 5), _b(7, 0)),  # past the retention: a no-op
        ),
    ),
    BudgetCase(
        "a reservation expires at exactly its expiry time",
        limit=100,
        steps=(
            (Reserve("a", 100, True, ttl_s=10.0), _b(0, 100)),
            (Advance(9.999), _b(0, 100)),
            (Reserve("b", 1, False), _b(0, 100)),
            (Advance(0.001), _b(0, 0)),
            (Reserve("c", 100, True), _b(0, 100)),
        ),
        targets=EXACT_TIME,
    ),
    BudgetCase(
        "the day rolls over at UTC midnight: a fresh balance; a late settle stays in its day",
        limit=100,
        start=datetime(2025, 6, 1, 23, 59, 59, 900_000, tzinfo=timezone.utc),
        steps=(
            (Reserve("a", 100, True), _b(0, 100)),
            (Reserve("b", 1, False), _b(0, 100)),
            (Advance(0.2), _b(0, 0)),  # 2025-06-02T00:00:00.1Z
            (Reserve("c", 100, True), _b(0, 100)),
            (Settle("a", 80), _b(0, 100)),  # charged to 2025-06-01
            (Reserve("d", 1, False), _b(0, 100)),
        ),
        ends_with=(("day:2025-06-01", _b(80, 0)), ("day:2025-06-02", _b(0, 100))),
    ),
    BudgetCase(
        "the month rolls over at 00:00 UTC on the first",
        limit=50,
        used=50,
        period="month",
        start=datetime(2025, 6, 30, 23, 59, 59, 900_000, tzinfo=timezone.utc),
        steps=(
            (Reserve("a", 1, False), _b(50, 0)),
            (Advance(0.2), _b(0, 0)),
            (Reserve("b", 50, True), _b(0, 50)),
        ),
        ends_with=(("month:2025-06", _b(50, 0)), ("month:2025-07", _b(0, 50))),
    ),
    BudgetCase(
        "a total budget never rolls over",
        limit=50,
        used=50,
        period="total",
        start=datetime(2025, 12, 31, 23, 59, 59, 900_000, tzinfo=timezone.utc),
        steps=(
            (Reserve("a", 1, False), _b(50, 0)),
            (Advance(0.2), _b(50, 0)),
            (Reserve("b", 1, False), _b(50, 0)),
        ),
    ),
    BudgetCase(
        "a zero budget admits nothing",
        limit=0,
        steps=((Reserve("a", 1, False), _b(0, 0)),),
    ),
    BudgetCase(
        "no limit admits anything",
        limit=None,
        used=10**12,
        steps=((Reserve("a", 10**9, True), _b(10**12, 10**9)),),
        targets=POLICY_ONLY,
    ),
)


def cases_for(target: Target) -> list[BudgetCase]:
    return [case for case in BUDGET_CASES if target in case.targets]


def case_id(case: BudgetCase) -> str:
    return case.name


TENANT = "acme"
# reserve(period_key, limit, tokens, ttl_s): a reservation, or None for a refusal
ReserveFn = Callable[[str, int, int, float], Awaitable[Reservation | None]]


async def run_on_ledger(
    case: BudgetCase,
    ledger: BudgetLedger,
    advance: Callable[[float], Awaitable[None]],
    reserve: ReserveFn | None = None,
) -> None:
    """Run every step of ``case`` on ``ledger`` and assert each decision and balance (but
    the balance right after an `Advance` that is not the last step).
    ``reserve`` replaces ``ledger.reserve`` (the admission step); ``advance`` lets the
    ledger's time pass."""
    limit = case.limit
    if limit is None:
        raise ValueError(f"{case.name!r} has no limit: the ledgers take one")
    now = case.start

    def period_key() -> str:
        return budget_window(case.period, now).key

    async def reserve_on_ledger(
        key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        return await ledger.reserve(TENANT, key, limit, tokens, ttl_s)

    reserve = reserve or reserve_on_ledger
    if case.used:
        assert await ledger.rebuild(TENANT, period_key(), case.used)
    held: dict[str, Reservation] = {}
    for n, (step, expected) in enumerate(case.steps, start=1):
        if isinstance(step, Reserve):
            reservation = await reserve(period_key(), limit, step.tokens, step.ttl_s)
            assert (reservation is not None) == step.is_admitted, step
            if reservation is not None:
                assert (reservation.tenant_id, reservation.period_key, reservation.tokens) == (
                    TENANT,
                    period_key(),
                    step.tokens,
                )
                held[step.name] = reservation
        elif isinstance(step, Settle):
            await ledger.settle(held[step.name], step.used_tokens)
        elif isinstance(step, Release):
            await ledger.release(held[step.name])
        else:
            now += timedelta(seconds=step.seconds)
            await advance(step.seconds)
            if n < len(case.steps):
                # Reading a balance purges what expired: the next step must see to it alone.
                continue
        assert await ledger.balance(TENANT, period_key()) == expected, step
    for key, balance in case.ends_with:
        assert await ledger.balance(TENANT, key) == balance, key
