from policies.prompt_length import check_prompt_length
from policies.quota import TenantQuota


def test_tenant_limit_inclusive():
    q = TenantQuota(max_prompt_tokens=1000)
    assert check_prompt_length(1000, q, context_window=8192) is None
    r = check_prompt_length(1001, q, context_window=8192)
    assert r is not None
    assert (r.status, r.code, r.type, r.param) == (
        400,
        "context_length_exceeded",
        "invalid_request_error",
        "messages",
    )
    assert "at most 1000 tokens" in r.message
    assert "1001" in r.message


def test_context_window_leaves_room_for_one_token():
    q = TenantQuota()
    assert check_prompt_length(8191, q, context_window=8192) is None
    r = check_prompt_length(8192, q, context_window=8192)
    assert r is not None
    assert "maximum context length is 8192 tokens" in r.message


def test_no_tenant_limit_only_context_window():
    assert check_prompt_length(100_000, TenantQuota(), context_window=131_072) is None


def test_smaller_of_the_two_applies():
    q = TenantQuota(max_prompt_tokens=100_000)
    r = check_prompt_length(5000, q, context_window=4096)
    assert r is not None
    assert "maximum context length is 4096" in r.message


def test_a_lower_bound_says_at_least():
    q = TenantQuota(max_prompt_tokens=1000)
    r = check_prompt_length(37_000, q, context_window=2048, is_lower_bound=True)
    assert r is not None
    assert "resulted in at least 37000 tokens" in r.message
    r = check_prompt_length(37_000, TenantQuota(), context_window=2048, is_lower_bound=True)
    assert r is not None
    assert "resulted in at least 37000 tokens" in r.message
