"""The in-process rate-limit store.

The rule itself (within, at and over the limits, the window rolling, limits that can never be
met) is the table of cases in ``tests/policies/rate_limit_cases.py``, which also runs against
the policy and through the admission step, in process and in Redis
(``tests/gateway/admission/test_admission_store.py``, where several gateways share one
Redis); the other tests here check what it cannot: tenants, and bad arguments."""

from __future__ import annotations

import pytest

from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.ratelimit.rate_limit_store import WindowState
from tests.policies.rate_limit_cases import (
    T0,
    TENANT,
    WINDOW_S,
    RateLimitCase,
    case_id,
    cases_for,
    check_hit,
)


@pytest.fixture
def store() -> MemoryRateLimitStore:
    return MemoryRateLimitStore(window_s=WINDOW_S)


@pytest.mark.parametrize("case", cases_for("memory"), ids=case_id)
async def test_rate_limit_cases(store: MemoryRateLimitStore, case: RateLimitCase) -> None:
    for hit in case.hits:
        rpm, tpm = case.limits_of(hit)
        check_hit(case, hit, await store.hit(TENANT, hit.tokens, rpm, tpm, now=T0 + hit.at))


async def test_requests_slide_out_of_the_window(store: MemoryRateLimitStore) -> None:
    first = await store.hit(TENANT, 5, rpm_limit=2, tpm_limit=None, now=T0)
    assert first == WindowState(
        is_admitted=True,
        window_s=60.0,
        num_requests=1,
        num_tokens=5,
        oldest_at=T0,
        newest_at=T0,
        requests_fit_at=T0,
        tokens_fit_at=T0,
    )
    assert (await store.hit(TENANT, 5, 2, None, now=T0 + 10)).is_admitted
    refused = await store.hit(TENANT, 5, 2, None, now=T0 + 20)
    assert refused == WindowState(
        is_admitted=False,
        window_s=60.0,
        num_requests=2,
        num_tokens=10,
        oldest_at=T0,
        newest_at=T0 + 10,
        requests_fit_at=T0 + 60,
        tokens_fit_at=T0 + 20,
    )
    assert not (await store.hit(TENANT, 5, 2, None, now=T0 + 59.999)).is_admitted
    at_expiry = await store.hit(TENANT, 5, 2, None, now=T0 + 60)  # the first hit just left
    assert at_expiry.is_admitted
    assert (at_expiry.num_requests, at_expiry.oldest_at, at_expiry.newest_at) == (
        2,
        T0 + 10,
        T0 + 60,
    )


async def test_tenants_have_separate_windows(store: MemoryRateLimitStore) -> None:
    assert (await store.hit("a", 10, rpm_limit=1, tpm_limit=10, now=T0)).is_admitted
    assert not (await store.hit("a", 1, rpm_limit=None, tpm_limit=10, now=T0)).is_admitted
    other = await store.hit("b", 10, rpm_limit=1, tpm_limit=10, now=T0)
    assert other.is_admitted
    assert other.num_tokens == 10


async def test_hit_rejects_bad_arguments(store: MemoryRateLimitStore) -> None:
    for tokens, rpm, tpm, name in [
        (-1, None, None, "tokens"),
        (1, -1, None, "rpm_limit"),
        (1, None, -1, "tpm_limit"),
    ]:
        with pytest.raises(ValueError, match=f"^{name} must be >= 0"):
            await store.hit(TENANT, tokens, rpm, tpm, now=T0)
