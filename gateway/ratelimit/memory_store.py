"""In-process sliding-window counters for a single gateway (see ``rate_limit_store``).

``hit`` never awaits, so on one event loop each call is atomic. Not thread-safe.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from gateway.ratelimit.rate_limit_store import (
    DEFAULT_WINDOW_S,
    WindowState,
    check_hit_args,
    check_window,
)
from policies.rate_limit import within_limit


@dataclass
class _Window:
    entries: list[tuple[float, int, int]] = field(default_factory=list)  # (ts, seq, tokens)
    num_tokens: int = 0

    def purge(self, cutoff: float) -> None:
        """Drop entries with ``ts <= cutoff``."""
        end = bisect.bisect_right(self.entries, (cutoff, float("inf"), 0))
        if end:
            self.num_tokens -= sum(tokens for _, _, tokens in self.entries[:end])
            del self.entries[:end]


class MemoryRateLimitStore:
    """``RateLimitStore`` kept in a dict of sorted per-tenant logs."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        check_window(window_s)
        self._window_s = window_s
        self._windows: dict[str, _Window] = {}
        self._seq = itertools.count()

    async def hit(
        self,
        tenant_id: str,
        tokens: int,
        rpm_limit: int | None,
        tpm_limit: int | None,
        now: float,
    ) -> WindowState:
        check_hit_args(tokens, rpm_limit, tpm_limit)
        window = self._windows.setdefault(tenant_id, _Window())
        window.purge(now - self._window_s)
        entries = window.entries
        requests_ok = within_limit(len(entries), 1, rpm_limit)
        tokens_ok = within_limit(window.num_tokens, tokens, tpm_limit)
        is_admitted = requests_ok and tokens_ok
        if is_admitted:
            bisect.insort(entries, (now, next(self._seq), tokens))
            window.num_tokens += tokens
        state = WindowState(
            is_admitted=is_admitted,
            window_s=self._window_s,
            num_requests=len(entries),
            num_tokens=window.num_tokens,
            oldest_at=entries[0][0] if entries else None,
            newest_at=entries[-1][0] if entries else None,
            requests_fit_at=now if requests_ok else self._requests_fit_at(entries, rpm_limit),
            tokens_fit_at=now
            if tokens_ok
            else self._tokens_fit_at(entries, window.num_tokens + tokens, tpm_limit),
        )
        if not entries:
            del self._windows[tenant_id]
        return state

    def _requests_fit_at(
        self, entries: list[tuple[float, int, int]], rpm_limit: int | None
    ) -> float | None:
        if not rpm_limit:  # 0: never fits (None cannot refuse)
            return None
        num_to_expire = len(entries) + 1 - rpm_limit
        return entries[num_to_expire - 1][0] + self._window_s

    def _tokens_fit_at(
        self, entries: list[tuple[float, int, int]], total: int, tpm_limit: int | None
    ) -> float | None:
        if tpm_limit is None:
            return None
        num_to_free = total - tpm_limit
        freed = 0
        for ts, _, tokens in entries:
            freed += tokens
            if freed >= num_to_free:
                return ts + self._window_s
        return None  # the request alone is larger than the limit
