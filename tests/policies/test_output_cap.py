from policies.decision import Rejection
from policies.output_cap import resolve_max_tokens
from policies.quota import TenantQuota

CAPPED = TenantQuota(max_output_tokens=1000, default_max_output_tokens=256)
CLAMPED = TenantQuota(max_output_tokens=1000, default_max_output_tokens=256, clamp_max_output=True)


def resolve(requested, quota, prompt_tokens=100, context_window=8192):
    return resolve_max_tokens(
        requested, quota, prompt_tokens=prompt_tokens, context_window=context_window
    )


def test_missing_max_tokens_gets_tenant_default():
    assert resolve(None, CAPPED) == 256


def test_missing_default_falls_back_to_cap_then_room():
    assert resolve(None, TenantQuota(max_output_tokens=1000)) == 1000
    assert resolve(None, TenantQuota(), prompt_tokens=100, context_window=8192) == 8092
    # No default: an answer may run to the context's end, capped by the tenant's output cap.
    capped = TenantQuota(max_output_tokens=4096)
    assert resolve(None, capped, prompt_tokens=100, context_window=2048) == 1948
    assert resolve(None, capped, prompt_tokens=100, context_window=32768) == 4096


def test_default_cut_to_room_silently():
    assert resolve(None, CAPPED, prompt_tokens=8000, context_window=8192) == 192


def test_exactly_at_cap_passes():
    assert resolve(1000, CAPPED) == 1000


def test_one_over_cap_rejected():
    r = resolve(1001, CAPPED)
    assert isinstance(r, Rejection)
    assert (r.status, r.code, r.type, r.param) == (
        400,
        "invalid_value",
        "invalid_request_error",
        "max_tokens",
    )
    assert "1001" in r.message
    assert "at most 1000" in r.message


def test_over_cap_clamped_when_quota_says_so():
    assert resolve(5000, CLAMPED) == 1000


def test_no_cap_is_unlimited_up_to_room():
    assert resolve(8092, TenantQuota()) == 8092


def test_over_room_rejected_or_clamped():
    r = resolve(8093, TenantQuota())
    assert isinstance(r, Rejection)
    assert r.code == "context_length_exceeded"
    assert "requested 8193 tokens (100 in the messages, 8093 in the completion)" in r.message
    clamp = TenantQuota(clamp_max_output=True)
    assert resolve(8093, clamp) == 8092
    # Clamped to the cap first, then to the room.
    assert resolve(5000, CLAMPED, prompt_tokens=7500) == 692


def test_max_tokens_below_one_rejected():
    r = resolve(0, CLAMPED)
    assert isinstance(r, Rejection)
    assert r.param == "max_tokens"
    assert r.status == 400


def test_prompt_filling_the_context_rejected():
    r = resolve(None, CAPPED, prompt_tokens=8192, context_window=8192)
    assert isinstance(r, Rejection)
    assert r.code == "context_length_exceeded"
