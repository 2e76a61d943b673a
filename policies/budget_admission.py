"""Admission against a tenant's token budget: a pure decision over the balances
the ledger reports.

A request is charged in two steps. Before forwarding, the gateway *reserves* its
worst case, ``prompt_tokens + num_choices * max_tokens`` (`reservation_tokens`: every
prompt of the request once, and each of its choices, ``n`` per prompt, running to
``max_tokens``, as OpenAI's usage counts them); when the
stream ends the ledger settles the reservation to the tokens actually used. The
invariant this policy keeps, for the budget window in force::

    used + reserved + request_tokens <= limit

where ``used`` is what settled requests consumed in the window and ``reserved``
the sum of reservations of requests still in flight. Admitting only requests
that keep it means concurrent requests can never overspend the budget, even if
every choice of every one of them runs to its ``max_tokens``. Exactly at the limit is
admitted.

`fits_budget` is that inequality, and the in-process ledger (``gateway/ledger/memory_ledger.py``)
calls it; the Redis ledger's Lua spells it again. One table of cases,
``tests/policies/budget_cases.py``, runs against this policy and both ledgers. Budgets below
the tenant and budgets in money (``policies/scoped_budgets.py``) keep the same invariant, each
in its unit, and refuse with the same words (`budget_rejection`), naming the budget.
"""

from __future__ import annotations

from policies.budget_period import BudgetWindow
from policies.decision import Rejection


def reservation_tokens(prompt_tokens: int, max_tokens: int, num_choices: int = 1) -> int:
    """The worst case a request can cost: its prompts (``prompt_tokens``, all of them, each
    counted once however many choices it has) plus the whole output allowance of each of its
    ``num_choices`` choices."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError(
            f"token counts must be non-negative, got prompt_tokens={prompt_tokens}, "
            f"max_tokens={max_tokens}"
        )
    if num_choices < 1:
        raise ValueError(f"num_choices must be at least 1, got {num_choices}")
    return prompt_tokens + num_choices * max_tokens


def fits_budget(*, used: int, reserved: int, request_tokens: int, limit: int | None) -> bool:
    """The invariant: ``used + reserved + request_tokens <= limit``; ``limit=None`` has none."""
    return limit is None or used + reserved + request_tokens <= limit


def admit_budget(
    *,
    used: int,
    reserved: int,
    request_tokens: int,
    limit: int | None,
    window: BudgetWindow | None = None,
) -> Rejection | None:
    """None to admit (and reserve ``request_tokens``), or a 429 ``insufficient_quota``.

    ``limit=None`` is an unlimited budget. ``window`` only improves the message
    (which period is exhausted and when it resets).
    """
    for name, value in (("used", used), ("reserved", reserved), ("request_tokens", request_tokens)):
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value}")
    if limit is None or fits_budget(
        used=used, reserved=reserved, request_tokens=request_tokens, limit=limit
    ):
        return None
    return budget_rejection(
        what="your token budget",
        in_micros=False,
        used=used,
        reserved=reserved,
        amount=request_tokens,
        limit=limit,
        window=window,
    )


def budget_rejection(
    *,
    what: str,
    in_micros: bool,
    used: int,
    reserved: int,
    amount: int,
    limit: int,
    window: BudgetWindow | None,
) -> Rejection:
    """The 429 ``insufficient_quota`` of a request ``amount`` does not fit: ``what`` names
    the budget (``your token budget``, ``the API key's budget of 5.00 USD (5000000 micros)``)."""
    period = f" for {window.key}" if window is not None else ""
    unit = " micros" if in_micros else ""
    if amount > limit:
        detail = (
            f"This request needs up to {amount}{unit}"
            f"{'' if in_micros else ' tokens'}, more than the whole budget of {limit}{unit}; "
            "lower max_tokens or shorten the prompt."
        )
    else:
        detail = (
            f"Used {used} and {reserved} reserved by requests in flight; this request needs "
            f"up to {amount}{unit} more (prompt plus max_tokens for each choice), limit "
            f"{limit}{unit}; lower max_tokens or wait."
        )
        if window is not None and window.end is not None:
            detail += f" The budget resets at {window.end.isoformat()}."
    return Rejection(
        status=429,
        code="insufficient_quota",
        type="insufficient_quota",
        message=f"You exceeded {what}{period}. {detail}",
    )
