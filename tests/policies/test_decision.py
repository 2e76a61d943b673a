import pytest

from policies.decision import Rejection


def test_error_body_is_openai_shaped():
    r = Rejection(400, "context_length_exceeded", "invalid_request_error", "too long", "messages")
    assert r.error_body() == {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }


def test_headers_are_copied_and_read_only():
    source = {"Retry-After": "3"}
    r = Rejection(429, "rate_limit_exceeded", "rate_limit_error", "slow down", headers=source)
    source["Retry-After"] = "99"
    assert r.headers == {"Retry-After": "3"}
    with pytest.raises(TypeError):
        r.headers["x"] = "y"  # type: ignore[index]


def test_default_headers_empty_and_param_none():
    r = Rejection(403, "model_not_allowed", "permission_error", "no")
    assert dict(r.headers) == {}
    assert r.error_body()["error"]["param"] is None


@pytest.mark.parametrize("status", [200, 399, 600])
def test_non_error_status_refused(status):
    with pytest.raises(ValueError, match="4xx or 5xx"):
        Rejection(status, "c", "t", "m")
