from dataclasses import dataclass

import pytest

from policies.decision import Rejection
from policies.rate_limit import (
    RateLimitAllowance,
    check_rate_limit,
    format_duration,
    within_limit,
)
from tests.policies.rate_limit_cases import (
    T0,
    RateLimitCase,
    ReferenceWindow,
    case_id,
    cases_for,
    check_hit,
)

NOW = 1_000_000.0


@dataclass(frozen=True)
class Report:
    """Stands in for the store's WindowState (same fields)."""

    is_admitted: bool
    num_requests: int
    num_tokens: int
    oldest_at: float | None
    newest_at: float | None
    requests_fit_at: float | None
    tokens_fit_at: float | None
    window_s: float = 60.0


def admitted(num_requests, num_tokens, oldest_at=NOW - 30, newest_at=NOW):
    return Report(True, num_requests, num_tokens, oldest_at, newest_at, NOW, NOW)


def test_admitted_headers_count_this_request():
    # rpm 10: 9 earlier + this one; tpm 1000: 600 + 400 (exactly at the limit).
    d = check_rate_limit(admitted(10, 1000), rpm=10, tpm=1000, request_tokens=400, now=NOW)
    assert isinstance(d, RateLimitAllowance)
    assert dict(d.headers) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m0s",
    }


def test_reset_is_when_the_newest_hit_expires():
    report = admitted(3, 300, oldest_at=NOW - 50, newest_at=NOW - 12.5)
    d = check_rate_limit(report, rpm=10, tpm=None, request_tokens=0, now=NOW)
    assert isinstance(d, RateLimitAllowance)
    assert d.headers["x-ratelimit-reset-requests"] == "47.5s"
    assert d.headers["x-ratelimit-remaining-requests"] == "7"


def test_no_limits_no_headers():
    d = check_rate_limit(admitted(5, 50), rpm=None, tpm=None, request_tokens=10, now=NOW)
    assert isinstance(d, RateLimitAllowance)
    assert dict(d.headers) == {}


def test_only_limited_dimension_gets_headers():
    d = check_rate_limit(admitted(5, 50), rpm=None, tpm=100, request_tokens=10, now=NOW)
    assert isinstance(d, RateLimitAllowance)
    assert set(d.headers) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }


def test_refused_on_requests_retry_after_rounds_up():
    # 10 hits in the window, the oldest expires in 20.2 s.
    report = Report(False, 10, 100, NOW - 39.8, NOW - 1, NOW + 20.2, NOW)
    r = check_rate_limit(report, rpm=10, tpm=1000, request_tokens=5, now=NOW)
    assert isinstance(r, Rejection)
    assert (r.status, r.code, r.type) == (429, "rate_limit_exceeded", "rate_limit_error")
    assert r.headers["Retry-After"] == "21"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-remaining-tokens"] == "900"
    assert r.headers["x-ratelimit-reset-requests"] == "59s"
    assert "requests per min (RPM): Limit 10, Used 10, Requested 1" in r.message
    assert "try again in 20.2s" in r.message


def test_retry_after_whole_seconds_not_bumped():
    report = Report(False, 10, 0, NOW - 48, NOW, NOW + 12.0, NOW)
    r = check_rate_limit(report, rpm=10, tpm=None, request_tokens=0, now=NOW)
    assert isinstance(r, Rejection)
    assert r.headers["Retry-After"] == "12"


def test_retry_after_at_least_one_second():
    report = Report(False, 10, 0, NOW - 59.9, NOW, NOW + 0.1, NOW)
    r = check_rate_limit(report, rpm=10, tpm=None, request_tokens=0, now=NOW)
    assert isinstance(r, Rejection)
    assert r.headers["Retry-After"] == "1"
    assert "try again in 100ms" in r.message


def test_both_exceeded_waits_for_the_later():
    report = Report(False, 10, 950, NOW - 50, NOW, NOW + 10, NOW + 33.5)
    r = check_rate_limit(report, rpm=10, tpm=1000, request_tokens=100, now=NOW)
    assert isinstance(r, Rejection)
    assert r.headers["Retry-After"] == "34"
    assert "tokens per min (TPM): Limit 1000, Used 950, Requested 100" in r.message


def test_request_larger_than_tpm_gets_no_retry_after():
    report = Report(False, 0, 0, None, None, NOW, None)
    r = check_rate_limit(report, rpm=10, tpm=1000, request_tokens=1001, now=NOW)
    assert isinstance(r, Rejection)
    assert "Retry-After" not in r.headers
    assert "Request too large for tokens per min (TPM): Limit 1000, Requested 1001" in r.message
    # Empty window: full capacity now.
    assert r.headers["x-ratelimit-reset-tokens"] == "0s"
    assert r.headers["x-ratelimit-remaining-tokens"] == "1000"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "0s"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (17.125, "17.125s"),
        (59.9996, "1m0s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (90.5, "1m30.5s"),
        (-3, "0s"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# -- the table of cases (tests/policies/rate_limit_cases.py), against the policy ------------


@pytest.mark.parametrize("case", cases_for("policy"), ids=case_id)
def test_rate_limit_cases_against_the_policy(case: RateLimitCase) -> None:
    window = ReferenceWindow()
    for hit in case.hits:
        rpm, tpm = case.limits_of(hit)
        check_hit(case, hit, window.hit(hit.tokens, rpm, tpm, now=T0 + hit.at))


@pytest.mark.parametrize(
    ("count", "cost", "limit", "is_within"),
    [
        (9, 1, 10, True),
        (10, 1, 10, False),
        (0, 0, 0, True),
        (0, 1, 0, False),
        (10**9, 1, None, True),
    ],
)
def test_within_limit_admits_exactly_at_the_limit(
    count: int, cost: int, limit: int | None, is_within: bool
) -> None:
    assert within_limit(count, cost, limit) == is_within
