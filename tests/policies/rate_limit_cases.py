"""Rate limits (requests and tokens per minute) as one table of cases, run against every
implementation of the rule.

The rule is written in three places: the contract and decision in ``policies/rate_limit.py``,
the in-process store (``gateway/ratelimit/memory_store.py``) and the Lua ``hit`` of the Redis
window (``gateway/ratelimit/redis_window.py``), which the admission script runs. Each
`RateLimitCase` is a sequence of hits of one
tenant, at times relative to ``T0``, and what each must see and decide. A case runs against
the targets in its ``targets`` (all of them unless it says otherwise):

- ``policy`` (``tests/policies/test_rate_limit.py``): `ReferenceWindow`, the store contract of
  ``policies/rate_limit.py`` written as plainly as it reads (``within_limit`` for the checks,
  and the fit times found by trying each instant a hit expires), then ``check_rate_limit``;
- ``memory`` (``tests/gateway/ratelimit/test_memory_store.py``): the in-process store's
  ``hit``, then ``check_rate_limit``;
- ``admission`` (``tests/gateway/admission/test_admission_store.py``): the same through the
  admission step, the gateway's own path, in process and in Redis (the rule's Redis arm: the
  Lua ``hit`` in the admission script, through redis-py and the gateway's own client). It
  does not consult the window of a request with no limit: such a hit must be admitted with
  nothing counted.

`check_hit` asserts what the table says of one hit, for any of them. The stores have no
refunds (a hit is never given back, e.g. when the request fails upstream), so there is no
case for one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import pytest

from policies.decision import Rejection
from policies.rate_limit import RateLimitAllowance, WindowReport, check_rate_limit, within_limit

T0 = 1_750_000_000.0
WINDOW_S = 60.0
TENANT = "acme"
NOW: Literal["now"] = "now"  # `Hit.passes_at` of a hit that passes at once

Target = Literal["policy", "memory", "admission"]
ALL: frozenset[Target] = frozenset({"policy", "memory", "admission"})


@dataclass(frozen=True)
class Hit:
    """One request of ``tokens`` at ``T0 + at`` and what the window must be after it.

    ``limits``: ``(rpm, tpm)`` for this hit if not the case's (a quota just changed).
    ``span``: ``(oldest, newest)`` hit in the window after it (offsets), None when empty.
    ``passes_at``: when this hit would pass both checks if nothing else were recorded (an
    offset); ``NOW`` when it passes at once; None when it never can.
    """

    at: float
    tokens: int
    is_admitted: bool
    num_requests: int
    num_tokens: int
    span: tuple[float, float] | None
    passes_at: float | Literal["now"] | None = NOW
    limits: tuple[int | None, int | None] | None = None


@dataclass(frozen=True)
class RateLimitCase:
    name: str
    rpm: int | None
    tpm: int | None
    hits: tuple[Hit, ...] = field(default=())
    targets: frozenset[Target] = ALL

    def limits_of(self, hit: Hit) -> tuple[int | None, int | None]:
        return hit.limits if hit.limits is not None else (self.rpm, self.tpm)


RATE_LIMIT_CASES: tuple[RateLimitCase, ...] = (
    RateLimitCase(
        "within the request limit",
        rpm=3,
        tpm=None,
        hits=(
            Hit(0, 5, True, 1, 5, (0, 0)),
            Hit(10, 5, True, 2, 10, (0, 10)),
        ),
    ),
    RateLimitCase(
        "at the request limit is admitted, one over is refused until the oldest leaves",
        rpm=2,
        tpm=None,
        hits=(
            Hit(0, 5, True, 1, 5, (0, 0)),
            Hit(10, 5, True, 2, 10, (0, 10)),  # exactly at the limit
            Hit(20, 5, False, 2, 10, (0, 10), passes_at=60),
            Hit(59.999, 5, False, 2, 10, (0, 10), passes_at=60),
            Hit(60, 5, True, 2, 10, (10, 60)),  # the first hit stops counting at exactly 60 s
        ),
    ),
    RateLimitCase(
        "refused hits are not counted, so retrying cannot lock a client out",
        rpm=1,
        tpm=None,
        hits=(
            Hit(0, 1, True, 1, 1, (0, 0)),
            Hit(1, 1, False, 1, 1, (0, 0), passes_at=60),
            Hit(30, 1, False, 1, 1, (0, 0), passes_at=60),
            Hit(59, 1, False, 1, 1, (0, 0), passes_at=60),
            Hit(60, 1, True, 1, 1, (60, 60)),
        ),
    ),
    RateLimitCase(
        "at the token limit is admitted; over it waits until enough tokens leave",
        rpm=None,
        tpm=100,
        hits=(
            Hit(0, 30, True, 1, 30, (0, 0)),
            Hit(10, 30, True, 2, 60, (0, 10)),
            Hit(20, 30, True, 3, 90, (0, 20)),
            Hit(30, 50, False, 3, 90, (0, 20), passes_at=70),  # 40 must leave: the first two
            Hit(30, 10, True, 4, 100, (0, 30)),  # exactly at the limit
            Hit(70, 50, True, 3, 90, (20, 70)),
        ),
    ),
    RateLimitCase(
        "the window rolls: each hit leaves exactly a window after it came",
        rpm=2,
        tpm=50,
        hits=(
            Hit(0, 20, True, 1, 20, (0, 0)),
            Hit(30, 20, True, 2, 40, (0, 30)),
            Hit(45, 20, False, 2, 40, (0, 30), passes_at=60),
            Hit(60, 20, True, 2, 40, (30, 60)),
            Hit(90, 20, True, 2, 40, (60, 90)),
            Hit(150, 50, True, 1, 50, (150, 150)),  # both earlier hits gone
            Hit(209.5, 1, False, 1, 50, (150, 150), passes_at=210),
        ),
    ),
    RateLimitCase(
        "over both limits: the later of the two fit times",
        rpm=2,
        tpm=100,
        hits=(
            Hit(0, 10, True, 1, 10, (0, 0)),
            Hit(5, 80, True, 2, 90, (0, 5)),
            Hit(10, 30, False, 2, 90, (0, 5), passes_at=65),  # requests at 60, tokens at 65
            Hit(10, 5, False, 2, 90, (0, 5), passes_at=60),  # only requests block
        ),
    ),
    RateLimitCase(
        "a lowered limit waits for enough hits to leave",
        rpm=4,
        tpm=None,
        hits=(
            Hit(0, 1, True, 1, 1, (0, 0)),
            Hit(5, 1, True, 2, 2, (0, 5)),
            Hit(10, 1, True, 3, 3, (0, 10)),
            Hit(15, 1, True, 4, 4, (0, 15)),
            Hit(20, 1, False, 4, 4, (0, 15), passes_at=70, limits=(2, None)),  # 3 must leave
        ),
    ),
    RateLimitCase(
        "a hit larger than the token limit can never pass and counts nothing",
        rpm=10,
        tpm=100,
        hits=(
            Hit(0, 101, False, 0, 0, None, passes_at=None),
            Hit(1, 100, True, 1, 100, (1, 1)),
            Hit(2, 101, False, 1, 100, (1, 1), passes_at=None),
        ),
    ),
    RateLimitCase(
        "a zero request limit can never pass",
        rpm=0,
        tpm=None,
        hits=(Hit(0, 1, False, 0, 0, None, passes_at=None),),
    ),
    RateLimitCase(
        "no limits admit everything",
        rpm=None,
        tpm=None,
        hits=tuple(Hit(i, 1000, True, i + 1, 1000 * (i + 1), (0, i)) for i in range(5)),
    ),
    RateLimitCase(
        "hits arriving out of order (replica clocks) count by their own times",
        rpm=3,
        tpm=None,
        hits=(
            Hit(10, 1, True, 1, 1, (10, 10)),
            Hit(5, 1, True, 2, 2, (5, 10)),
            Hit(12, 1, True, 3, 3, (5, 12)),
            Hit(20, 1, False, 3, 3, (5, 12), passes_at=65),
        ),
    ),
)


def case_id(case: RateLimitCase) -> str:
    return case.name


def cases_for(target: Target) -> list[RateLimitCase]:
    return [case for case in RATE_LIMIT_CASES if target in case.targets]


@dataclass(frozen=True)
class ReferenceState:
    """What a store reports for one hit (``policies.rate_limit.WindowReport``)."""

    is_admitted: bool
    window_s: float
    num_requests: int
    num_tokens: int
    oldest_at: float | None
    newest_at: float | None
    requests_fit_at: float | None
    tokens_fit_at: float | None


class ReferenceWindow:
    """The store contract of ``policies/rate_limit.py``, plainly: the admitted hits with
    ``now - window_s < ts``; a hit passes a dimension iff ``within_limit``; its fit time is
    the earliest instant, from ``now`` on, at which it would pass if nothing were recorded."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.hits: list[tuple[float, int]] = []  # (ts, tokens)

    def _live(self, now: float) -> list[tuple[float, int]]:
        return [(ts, tokens) for ts, tokens in self.hits if now - self.window_s < ts]

    def _passes(
        self, at: float, tokens: int, rpm: int | None, tpm: int | None
    ) -> tuple[bool, bool]:
        live = self._live(at)
        return (
            within_limit(len(live), 1, rpm),
            within_limit(sum(t for _, t in live), tokens, tpm),
        )

    def _fit_at(
        self, now: float, tokens: int, check: int, rpm: int | None, tpm: int | None
    ) -> float | None:
        expiries = sorted(ts + self.window_s for ts, _ in self.hits if ts + self.window_s > now)
        for instant in (now, *expiries):
            if self._passes(instant, tokens, rpm, tpm)[check]:
                return instant
        return None

    def hit(self, tokens: int, rpm: int | None, tpm: int | None, now: float) -> ReferenceState:
        self.hits = self._live(now)
        requests_ok, tokens_ok = self._passes(now, tokens, rpm, tpm)
        requests_fit_at = self._fit_at(now, tokens, 0, rpm, tpm)
        tokens_fit_at = self._fit_at(now, tokens, 1, rpm, tpm)
        is_admitted = requests_ok and tokens_ok
        if is_admitted:
            self.hits.append((now, tokens))
        times = [ts for ts, _ in self.hits]
        return ReferenceState(
            is_admitted=is_admitted,
            window_s=self.window_s,
            num_requests=len(self.hits),
            num_tokens=sum(t for _, t in self.hits),
            oldest_at=min(times) if times else None,
            newest_at=max(times) if times else None,
            requests_fit_at=requests_fit_at,
            tokens_fit_at=tokens_fit_at,
        )


def check_hit(case: RateLimitCase, hit: Hit, state: WindowReport) -> None:
    """Assert that ``state`` (what a target saw for ``hit``) and the policy's decision on it
    are what the table says."""
    now = T0 + hit.at
    rpm, tpm = case.limits_of(hit)
    where = f"hit at +{hit.at}s of {hit.tokens} tokens"
    assert state.is_admitted == hit.is_admitted, where
    assert (state.num_requests, state.num_tokens) == (hit.num_requests, hit.num_tokens), where
    span = None
    if state.oldest_at is not None and state.newest_at is not None:
        span = (state.oldest_at - T0, state.newest_at - T0)
    if hit.span is None:
        assert span is None, where
    else:
        assert span == pytest.approx(hit.span, abs=1e-6), where
    fits = (state.requests_fit_at, state.tokens_fit_at)
    passes_at = None if None in fits else max(f for f in fits if f is not None) - T0
    expected = hit.at if hit.passes_at == NOW else hit.passes_at
    if expected is None:
        assert passes_at is None, where
    else:
        assert passes_at == pytest.approx(expected, abs=1e-6), where

    decision = check_rate_limit(state, rpm=rpm, tpm=tpm, request_tokens=hit.tokens, now=now)
    assert isinstance(decision, RateLimitAllowance) == hit.is_admitted, where
    for name, limit, count in (
        ("requests", rpm, hit.num_requests),
        ("tokens", tpm, hit.num_tokens),
    ):
        if limit is None:
            assert f"x-ratelimit-limit-{name}" not in decision.headers, where
        else:
            remaining = decision.headers[f"x-ratelimit-remaining-{name}"]
            assert remaining == str(max(0, limit - count)), where
    if isinstance(decision, Rejection):
        if expected is None:
            assert "Retry-After" not in decision.headers, where
        else:
            wait_s = max(1, math.ceil(round(expected - hit.at, 3)))
            assert decision.headers["Retry-After"] == str(wait_s), where
