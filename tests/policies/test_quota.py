import json

import pytest

from policies.quota import TenantQuota


def full_quota():
    return TenantQuota(
        budget_tokens=1_000_000,
        budget_period="day",
        max_output_tokens=4096,
        default_max_output_tokens=1024,
        clamp_max_output=True,
        max_prompt_tokens=8000,
        rpm=60,
        tpm=100_000,
        allowed_models=frozenset({"small", "auto"}),
        priority="batch",
        tier="pro",
        allow_fallback_to_small=True,
    )


def test_defaults_are_unlimited():
    q = TenantQuota()
    assert q.budget_tokens is None
    assert q.rpm is None
    assert q.tpm is None
    assert q.allowed_models is None
    assert q.priority == "interactive"
    assert q.budget_period == "month"


def test_json_round_trip():
    q = full_quota()
    data = q.to_dict()
    assert data["allowed_models"] == ["auto", "small"]
    assert TenantQuota.from_dict(json.loads(json.dumps(data))) == q


def test_round_trip_with_none_models_and_empty_models():
    assert TenantQuota.from_dict(TenantQuota().to_dict()) == TenantQuota()
    locked = TenantQuota(allowed_models=frozenset())
    assert locked.to_dict()["allowed_models"] == []
    assert TenantQuota.from_dict(locked.to_dict()) == locked


def test_from_dict_missing_keys_take_defaults():
    assert TenantQuota.from_dict({"rpm": 5}) == TenantQuota(rpm=5)


def test_from_dict_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"unknown tenant quota field.*rpn"):
        TenantQuota.from_dict({"rpn": 5})


def test_from_dict_models_must_be_a_list():
    with pytest.raises(ValueError, match="allowed_models must be a list"):
        TenantQuota.from_dict({"allowed_models": "small"})


@pytest.mark.parametrize(
    "field", ["budget_tokens", "max_output_tokens", "max_prompt_tokens", "rpm", "tpm"]
)
@pytest.mark.parametrize("value", [0, -1])
def test_counts_must_be_positive(field, value):
    with pytest.raises(ValueError, match=f"{field} must be at least 1"):
        TenantQuota(**{field: value})


@pytest.mark.parametrize("value", [True, 1.5, "10"])
def test_counts_must_be_ints(value):
    with pytest.raises(ValueError, match="rpm must be a positive integer"):
        TenantQuota(rpm=value)


def test_count_of_one_is_valid():
    assert TenantQuota(rpm=1).rpm == 1


def test_bad_period_and_priority():
    with pytest.raises(ValueError, match="budget_period must be one of day, month, total"):
        TenantQuota(budget_period="week")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority must be one of interactive, batch"):
        TenantQuota(priority="urgent")  # type: ignore[arg-type]


def test_default_above_cap_is_refused_but_equal_is_fine():
    with pytest.raises(ValueError, match=r"default_max_output_tokens \(513\) exceeds"):
        TenantQuota(max_output_tokens=512, default_max_output_tokens=513)
    assert TenantQuota(max_output_tokens=512, default_max_output_tokens=512)


def test_allowed_models_must_be_frozenset_of_names():
    with pytest.raises(ValueError, match="frozenset"):
        TenantQuota(allowed_models={"a"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty names"):
        TenantQuota(allowed_models=frozenset({""}))


def test_tier_and_flags():
    with pytest.raises(ValueError, match="tier must be a non-empty string"):
        TenantQuota(tier=" ")
    with pytest.raises(ValueError, match="clamp_max_output must be true or false"):
        TenantQuota(clamp_max_output=1)  # type: ignore[arg-type]


def test_alert_thresholds_are_kept_as_a_tuple_and_stored_as_a_list():
    quota = TenantQuota.from_dict({"budget_tokens": 10, "alert_thresholds": [50, 90]})
    assert quota.alert_thresholds == (50, 90)
    assert quota.to_dict()["alert_thresholds"] == [50, 90]
    assert json.loads(json.dumps(quota.to_dict())) == quota.to_dict()
    assert TenantQuota.from_dict(quota.to_dict()) == quota
    assert TenantQuota().alert_thresholds is None  # the alerts: settings' default
    with pytest.raises(ValueError, match=r"^alert_thresholds "):
        TenantQuota.from_dict({"alert_thresholds": [90, 50]})
