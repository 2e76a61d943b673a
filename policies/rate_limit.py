"""Requests and tokens per minute: the decision, ``Retry-After`` and OpenAI's
``x-ratelimit-*`` headers for one sliding-window check.

The store (``gateway/ratelimit/rate_limit_store.py``) checks and records a hit in one atomic
step, so replicas cannot race past a limit; it reports what it saw as a
`WindowReport`. Its contract, all times unix seconds on the caller's clock:

- The window holds the admitted hits with ``now - window_s < ts``: a hit stops
  counting exactly ``window_s`` after it was recorded.
- A hit costs 1 request and ``request_tokens`` tokens (the prompts plus max_tokens for
  each choice: the figure the budget reserves, `reservation_tokens`). It is admitted iff
  in every limited dimension ``count + cost <= limit`` (`within_limit`); exactly at the
  limit is admitted.
- ``num_requests`` / ``num_tokens``: the window after the hit (including it only if
  admitted). ``oldest_at`` / ``newest_at``: its oldest and newest hits (None if empty).
- ``requests_fit_at`` / ``tokens_fit_at``: the earliest time at which this hit would
  pass that check if nothing else were recorded, i.e. when enough of the oldest hits
  have expired; ``now`` if it passes now; None if it never can (cost above the limit).

From that, `check_rate_limit` derives (a dimension with no limit gets no headers):

- ``x-ratelimit-limit-*``: the limit.
- ``x-ratelimit-remaining-*``: ``limit - count``, after this request if admitted.
- ``x-ratelimit-reset-*``: time until the dimension is back to full capacity (the
  newest hit expires: ``newest_at + window_s - now``; ``0s`` if it holds nothing),
  in OpenAI's duration format (``"250ms"``, ``"1.5s"``, ``"1m0s"``).
- ``Retry-After`` (refusals only): whole seconds, rounded up and at least 1, until
  the hit passes both checks: ``max(requests_fit_at, tokens_fit_at) - now``. A hit
  that can never pass gets none: retrying cannot help.

The in-process store calls `within_limit`; the Redis store's Lua spells the contract
again. One table of cases, ``tests/policies/rate_limit_cases.py``, runs against this
contract (a reference window kept by the test, then `check_rate_limit`) and both stores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from policies.decision import Rejection


class WindowReport(Protocol):
    """What the store saw and did for one hit (``gateway.ratelimit``'s ``WindowState``)."""

    @property
    def is_admitted(self) -> bool: ...
    @property
    def window_s(self) -> float: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def oldest_at(self) -> float | None: ...
    @property
    def newest_at(self) -> float | None: ...
    @property
    def requests_fit_at(self) -> float | None: ...
    @property
    def tokens_fit_at(self) -> float | None: ...


@dataclass(frozen=True)
class RateLimitAllowance:
    """The request may go ahead; put ``headers`` on the response."""

    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))


@dataclass(frozen=True)
class _Dimension:
    name: str  # "requests" or "tokens", as in the header names
    label: str
    limit: int
    count: int
    cost: int
    fit_at: float | None


def within_limit(count: int, cost: int, limit: int | None) -> bool:
    """One dimension's check: ``count + cost <= limit``; ``limit=None`` has none."""
    return limit is None or count + cost <= limit


def check_rate_limit(
    report: WindowReport,
    *,
    rpm: int | None,
    tpm: int | None,
    request_tokens: int,
    now: float,
) -> RateLimitAllowance | Rejection:
    """Allow with headers, or a 429 ``rate_limit_exceeded`` with Retry-After and headers.

    ``rpm``, ``tpm`` and ``request_tokens`` must be those the store checked against.
    """
    dims: list[_Dimension] = []
    if rpm is not None:
        dims.append(
            _Dimension(
                "requests",
                "requests per min (RPM)",
                rpm,
                report.num_requests,
                1,
                report.requests_fit_at,
            )
        )
    if tpm is not None:
        dims.append(
            _Dimension(
                "tokens",
                "tokens per min (TPM)",
                tpm,
                report.num_tokens,
                request_tokens,
                report.tokens_fit_at,
            )
        )
    headers: dict[str, str] = {}
    for dim in dims:
        full_at = report.newest_at + report.window_s if report.newest_at is not None else now
        reset_s = full_at - now if dim.count > 0 else 0.0
        headers[f"x-ratelimit-limit-{dim.name}"] = str(dim.limit)
        headers[f"x-ratelimit-remaining-{dim.name}"] = str(max(0, dim.limit - dim.count))
        headers[f"x-ratelimit-reset-{dim.name}"] = format_duration(reset_s)
    if report.is_admitted:
        return RateLimitAllowance(headers)

    never = [d for d in dims if d.fit_at is None]
    if never:
        dim = never[0]
        message = (
            f"Request too large for {dim.label}: Limit {dim.limit}, Requested {dim.cost}. "
            "Lower max_tokens or shorten the prompt."
        )
    else:
        blocking = [d for d in dims if d.fit_at is not None and d.fit_at > now] or dims
        dim = max(blocking, key=lambda d: d.fit_at or now)
        wait_s = round((dim.fit_at or now) - now, 3)
        headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
        message = (
            f"Rate limit reached for {dim.label}: Limit {dim.limit}, Used {dim.count}, "
            f"Requested {dim.cost}. Please try again in {format_duration(max(wait_s, 0.0))}."
        )
    return Rejection(
        status=429,
        code="rate_limit_exceeded",
        type="rate_limit_error",
        message=message,
        headers=headers,
    )


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"0s"``, ``"250ms"``, ``"1.5s"``, ``"1m0s"``."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    secs = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
