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

Budgets at three levels (``policies/scoped_budgets.py``) have a second table, `SCOPED_CASES`:
several budgets (tenant, key, end user; tokens or micros) that one request must all fit.
Its steps are requests (`Ask`: a prompt, ``max_tokens``, ``n``), settlements with the
engine's usage (`SettleUsage`, cached tokens apart) and releases, each followed by every
budget's balance. Against the policy (`run_scoped_on_policy`) the table's balances must be
what ``reservation_amount``, ``settlement_amount`` and ``admit_budgets`` make of them; against
a ledger or the admission step (`run_scoped_on_ledger`) every balance must be the table's,
and a refusal must name the budget the table names.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Literal

from gateway.ledger.budget_ledger import (
    Balance,
    BudgetAccount,
    BudgetLedger,
    HoldAsk,
    Refused,
    Reservation,
)
from gateway.settings import Prices
from policies.budget_admission import fits_budget
from policies.budget_period import budget_window
from policies.quota import BudgetPeriod
from policies.scoped_budgets import (
    BudgetCheck,
    ScopedBudget,
    admit_budgets,
    reservation_amount,
    settlement_amount,
)

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


# -- budgets at three levels, in tokens or money ----------------------------------------------

# Micros per million tokens: 1 micro a prompt token, 0.25 a cached one, 4 an output token.
PRICES = Prices(input=1_000_000, cached_input=250_000, output=4_000_000)


def tenant_tokens(limit: int) -> ScopedBudget:
    return ScopedBudget("tenant", "tokens", limit, "day")


def tenant_micros(limit: int) -> ScopedBudget:
    return ScopedBudget("tenant", "micros", limit, "day")


def key_budget(limit: int, unit: Literal["tokens", "micros"] = "tokens") -> ScopedBudget:
    return ScopedBudget("key", unit, limit, "day", subject="key-1")


def user_budget(limit: int, unit: Literal["tokens", "micros"] = "tokens") -> ScopedBudget:
    return ScopedBudget("user", unit, limit, "day", subject="alice")


@dataclass(frozen=True)
class Ask:
    """A request of ``prompt_tokens`` and ``num_choices`` choices of ``max_tokens`` each;
    ``refused_by``: the index of the budget that refuses it (None: admitted)."""

    name: str
    prompt_tokens: int
    max_tokens: int
    refused_by: int | None = None
    num_choices: int = 1


@dataclass(frozen=True)
class SettleUsage:
    """The engine's usage for an admitted `Ask`."""

    name: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


ScopedStep = Ask | SettleUsage | Release


@dataclass(frozen=True)
class ScopedCase:
    """``budgets`` in the order tenant, key, end user; each step is followed by every
    budget's balance, in that order. ``used``: each budget's, before the first step."""

    name: str
    budgets: tuple[ScopedBudget, ...]
    steps: tuple[tuple[ScopedStep, tuple[Balance, ...]], ...]
    used: tuple[int, ...] = ()
    prices: Prices = PRICES

    def start_balances(self) -> tuple[Balance, ...]:
        used = self.used or (0,) * len(self.budgets)
        return tuple(Balance(used=u, reserved=0) for u in used)

    def amounts(self, ask: Ask) -> list[int]:
        """What ``ask`` reserves against each budget (the policy's rule)."""
        return [
            reservation_amount(
                b.unit, self.prices, ask.prompt_tokens, ask.max_tokens, ask.num_choices
            )
            for b in self.budgets
        ]

    def charges(self, usage: SettleUsage) -> list[int]:
        return [
            settlement_amount(
                b.unit,
                self.prices,
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens,
            )
            for b in self.budgets
        ]


SCOPED_CASES: tuple[ScopedCase, ...] = (
    ScopedCase(
        "a key's budget refuses what the tenant's allows, and nothing is held (all or none)",
        budgets=(tenant_tokens(1000), key_budget(100)),
        steps=(
            (Ask("a", 50, 30), (_b(0, 80), _b(0, 80))),
            (Ask("b", 10, 20, refused_by=1), (_b(0, 80), _b(0, 80))),
            (SettleUsage("a", 50, 0, 10), (_b(60, 0), _b(60, 0))),
            (Ask("c", 20, 20), (_b(60, 40), _b(60, 40))),  # the key's limit, exactly
        ),
    ),
    ScopedCase(
        "an end user's budget refuses what the tenant's and the key's allow; release frees all",
        budgets=(tenant_tokens(10_000), key_budget(10_000), user_budget(50)),
        steps=(
            (Ask("a", 30, 20), (_b(0, 50), _b(0, 50), _b(0, 50))),
            (Ask("b", 1, 0, refused_by=2), (_b(0, 50), _b(0, 50), _b(0, 50))),
            (Release("a"), (_b(0, 0), _b(0, 0), _b(0, 0))),
            (Ask("c", 1, 0), (_b(0, 1), _b(0, 1), _b(0, 1))),
        ),
    ),
    ScopedCase(
        "money reserves the prompt at the input price and each choice's output at the output price",
        budgets=(user_budget(1000, "micros"),),
        steps=(
            (Ask("a", 100, 100), (_b(0, 500),)),  # 100 x 1 + 100 x 4
            (Ask("b", 100, 25, num_choices=4), (_b(0, 1000),)),  # 100 x 1 + 4 x 25 x 4
            (Ask("c", 1, 0, refused_by=0), (_b(0, 1000),)),
        ),
    ),
    ScopedCase(
        "cached input tokens settle at the cached price; the reservation assumed none",
        budgets=(key_budget(10_000, "micros"),),
        steps=(
            (Ask("a", 400, 100), (_b(0, 800),)),  # 400 x 1 + 100 x 4
            (SettleUsage("a", 400, 300, 50), (_b(375, 0),)),  # 100 x 1 + 300 x 0.25 + 50 x 4
            (Ask("b", 1000, 2000), (_b(375, 9000),)),
            (Ask("c", 700, 0, refused_by=0), (_b(375, 9000),)),  # 375 + 9000 + 700 > 10,000
        ),
    ),
    ScopedCase(
        "a request within the tenant's token budget but over its money budget",
        budgets=(tenant_tokens(1000), tenant_micros(300)),
        steps=(
            (Ask("a", 100, 50), (_b(0, 150), _b(0, 300))),
            (Ask("b", 1, 0, refused_by=1), (_b(0, 150), _b(0, 300))),
        ),
    ),
    ScopedCase(
        "the first budget that refuses is named: tenant, then key, then end user",
        budgets=(tenant_tokens(100), key_budget(50), user_budget(50)),
        used=(95, 50, 50),
        steps=(
            (Ask("a", 10, 0, refused_by=0), (_b(95, 0), _b(50, 0), _b(50, 0))),
            (Ask("b", 5, 0, refused_by=1), (_b(95, 0), _b(50, 0), _b(50, 0))),
        ),
    ),
    ScopedCase(
        "settling charges each budget in its own unit",
        budgets=(tenant_tokens(1000), user_budget(10_000, "micros")),
        steps=(
            (Ask("a", 100, 100), (_b(0, 200), _b(0, 500))),
            # tokens 100 + 60; micros 60 x 1 + 40 x 0.25 + 60 x 4
            (SettleUsage("a", 100, 40, 60), (_b(160, 0), _b(310, 0))),
        ),
    ),
    ScopedCase(
        "money rounds up to a whole micro",
        budgets=(user_budget(2, "micros"),),
        prices=Prices(input=1, cached_input=0, output=1),
        steps=(
            (Ask("a", 10, 10), (_b(0, 1),)),  # 20 millionths of a micro: 1
            (Ask("b", 10, 10), (_b(0, 2),)),
            (Ask("c", 1, 0, refused_by=0), (_b(0, 2),)),
            (SettleUsage("a", 10, 10, 0), (_b(0, 1),)),  # cached input is free here
        ),
    ),
)


def scoped_case_id(case: ScopedCase) -> str:
    return case.name


def run_scoped_on_policy(case: ScopedCase) -> None:
    """The table's balances follow from the policy: each `Ask` reserves ``amounts`` against
    every budget if ``admit_budgets`` admits it (else nothing), a refusal names the budget
    the table names, and a settle adds ``charges`` to ``used``."""
    balances = case.start_balances()
    held: dict[str, list[int]] = {}
    for step, expected in case.steps:
        if isinstance(step, Ask):
            amounts = case.amounts(step)
            checks = [
                BudgetCheck(budget, b.used, b.reserved, amount)
                for budget, b, amount in zip(case.budgets, balances, amounts, strict=True)
            ]
            rejection = admit_budgets(checks, "EUR")
            first_unfit = next(
                (
                    i
                    for i, c in enumerate(checks)
                    if not fits_budget(
                        used=c.used,
                        reserved=c.reserved,
                        request_tokens=c.amount,
                        limit=c.budget.limit,
                    )
                ),
                None,
            )
            assert first_unfit == step.refused_by, step
            assert (rejection is None) == (step.refused_by is None), step
            if rejection is None:
                held[step.name] = amounts
                balances = tuple(
                    Balance(b.used, b.reserved + a) for b, a in zip(balances, amounts, strict=True)
                )
            else:
                assert (rejection.status, rejection.code) == (429, "insufficient_quota")
                refused = case.budgets[first_unfit or 0]
                assert refused.describe("EUR") in rejection.message, rejection.message
                if refused.unit == "micros":  # money is named in the prices' currency
                    assert " EUR (" in rejection.message, rejection.message
        else:
            amounts = held.pop(step.name)
            charges = case.charges(step) if isinstance(step, SettleUsage) else [0] * len(amounts)
            balances = tuple(
                Balance(b.used + c, b.reserved - a)
                for b, a, c in zip(balances, amounts, charges, strict=True)
            )
        assert balances == expected, step


# reserve_all(asks, ttl_s): every hold, or the index of the first ask that refused
ReserveAllFn = Callable[[list[HoldAsk], float], Awaitable[Reservation | Refused]]


async def run_scoped_on_ledger(
    case: ScopedCase, ledger: BudgetLedger, reserve_all: ReserveAllFn | None = None
) -> None:
    """Run every step on ``ledger`` (reserving through ``reserve_all`` if given: the
    admission step) and assert each refusal's index and every balance after each step."""
    accounts = [BudgetAccount.of(b) for b in case.budgets]
    keys = [budget_window(b.period, NOON).key for b in case.budgets]

    async def reserve_on_ledger(asks: list[HoldAsk], ttl_s: float) -> Reservation | Refused:
        return await ledger.reserve_all(TENANT, asks, ttl_s)

    reserve_all = reserve_all or reserve_on_ledger
    for account, key, balance in zip(accounts, keys, case.start_balances(), strict=True):
        assert await ledger.rebuild(TENANT, key, balance.used, account)
    held: dict[str, Reservation] = {}
    for step, expected in case.steps:
        if isinstance(step, Ask):
            asks = [
                HoldAsk(account, key, budget.limit, amount)
                for account, key, budget, amount in zip(
                    accounts, keys, case.budgets, case.amounts(step), strict=True
                )
            ]
            result = await reserve_all(asks, TTL_S)
            if isinstance(result, Refused):
                assert result.index == step.refused_by, step
                assert result.balance == expected[result.index], step
            else:
                assert step.refused_by is None, step
                assert len(result.holds) == len(asks)
                held[step.name] = result
        elif isinstance(step, SettleUsage):
            charges = dict(zip((b.unit for b in case.budgets), case.charges(step), strict=False))
            await ledger.settle(held[step.name], charges.get("tokens", 0), charges.get("micros", 0))
        else:
            await ledger.release(held[step.name])
        balances = [
            await ledger.balance(TENANT, key, account)
            for account, key in zip(accounts, keys, strict=True)
        ]
        assert tuple(balances) == expected, step
