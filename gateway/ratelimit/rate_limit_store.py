"""Sliding-window request and token counters per tenant: what a rate-limit policy reads.

A window holds the *admitted* hits of one tenant with ``now - window_s < ts`` (a hit stops
counting exactly ``window_s`` after it was recorded). ``hit`` is one atomic check-and-record:

    fits = (rpm_limit is None or num_requests + 1 <= rpm_limit)
       and (tpm_limit is None or num_tokens + tokens <= tpm_limit)

and only if it fits is the hit recorded. A refused hit changes nothing, so a client that
retries in a loop cannot lock itself out. Implementations: ``memory_store`` (one gateway)
and ``redis_window``'s Lua ``hit``, which the admission script runs (counts shared by all
replicas) and ``redis_store`` runs alone (`RateLimitStore` both stores satisfy).

The store only counts; turning a ``WindowState`` into a decision, ``Retry-After`` and the
``x-ratelimit-*`` headers is the policy's job (``policies/rate_limit.py``), e.g.::

    retry_after_s              = max(requests_fit_at, tokens_fit_at) - now   (refused hits)
    x-ratelimit-remaining-*    = limit - num_requests / num_tokens
    x-ratelimit-reset-*        = newest_at + window_s - now  (back to full capacity)

The contract is the policy's (its docstring); ``tests/policies/rate_limit_cases.py`` runs one
table of cases against it, the in-process store and the admission step (in process and in
Redis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DEFAULT_WINDOW_S = 60.0


@dataclass(frozen=True)
class WindowState:
    """What one ``hit`` saw and did. Times are unix seconds on the caller's clock (``now``).

    - ``is_admitted``: the hit fit both limits and was recorded.
    - ``window_s``: the window length.
    - ``num_requests`` / ``num_tokens``: requests and tokens in the window *after* this hit
      (including it only if admitted).
    - ``oldest_at`` / ``newest_at``: timestamps of the oldest and newest counted hits
      (``None`` when the window is empty, which can only happen after a refused hit).
    - ``requests_fit_at``: the earliest time at which this hit passes the requests check if no
      other hit is recorded meanwhile: ``now`` when it passes now (always so when admitted),
      ``None`` when it never can (``rpm_limit == 0``).
    - ``tokens_fit_at``: the same for the tokens check; ``None`` when ``tokens > tpm_limit``.
    """

    is_admitted: bool
    window_s: float
    num_requests: int
    num_tokens: int
    oldest_at: float | None
    newest_at: float | None
    requests_fit_at: float | None
    tokens_fit_at: float | None


class RateLimitStore(Protocol):
    """One atomic check-and-record of a hit in ``tenant_id``'s window (any subject's: the
    console counts sign-in attempts per client address)."""

    async def hit(
        self,
        tenant_id: str,
        tokens: int,
        rpm_limit: int | None,
        tpm_limit: int | None,
        now: float,
    ) -> WindowState: ...


class RateLimitUnavailable(Exception):
    """The store could not count a hit (its Redis is unreachable or too slow)."""


def check_hit_args(tokens: int, rpm_limit: int | None, tpm_limit: int | None) -> None:
    """Raise ``ValueError`` for arguments no implementation accepts."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if rpm_limit is not None and rpm_limit < 0:
        raise ValueError(f"rpm_limit must be >= 0 or None, got {rpm_limit}")
    if tpm_limit is not None and tpm_limit < 0:
        raise ValueError(f"tpm_limit must be >= 0 or None, got {tpm_limit}")


def check_window(window_s: float) -> None:
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
