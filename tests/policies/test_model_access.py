from policies.model_access import check_model_access
from policies.quota import TenantQuota

KNOWN = {"small-1b", "large-8b", "auto"}


def test_unknown_model_is_404_even_if_allowed_list_names_it():
    q = TenantQuota(allowed_models=frozenset({"ghost"}))
    r = check_model_access("ghost", q, KNOWN)
    assert r is not None
    assert (r.status, r.code, r.type, r.param) == (
        404,
        "model_not_found",
        "invalid_request_error",  # OpenAI's type for it
        "model",
    )
    assert r.message == "The model `ghost` does not exist or you do not have access to it."


def test_none_allows_every_known_model():
    for model in KNOWN:
        assert check_model_access(model, TenantQuota(), KNOWN) is None


def test_not_allowed_is_403():
    q = TenantQuota(allowed_models=frozenset({"small-1b", "auto"}))
    assert check_model_access("small-1b", q, KNOWN) is None
    assert check_model_access("auto", q, KNOWN) is None
    r = check_model_access("large-8b", q, KNOWN)
    assert r is not None
    assert (r.status, r.code, r.type) == (403, "model_not_allowed", "permission_error")


def test_empty_allow_list_locks_out():
    q = TenantQuota(allowed_models=frozenset())
    r = check_model_access("small-1b", q, KNOWN)
    assert r is not None
    assert r.status == 403
