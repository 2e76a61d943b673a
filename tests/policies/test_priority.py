import pytest

from policies.decision import Rejection
from policies.priority import resolve_priority
from policies.quota import TenantQuota

INTERACTIVE = TenantQuota(priority="interactive")
BATCH = TenantQuota(priority="batch")


def test_tenant_default_when_nothing_else():
    assert resolve_priority(None, None, INTERACTIVE) == "interactive"
    assert resolve_priority(None, None, BATCH) == "batch"


def test_key_default_overrides_tenant():
    assert resolve_priority(None, "batch", INTERACTIVE) == "batch"


def test_header_overrides_key():
    assert resolve_priority("interactive", "batch", INTERACTIVE) == "interactive"
    assert resolve_priority("batch", "interactive", INTERACTIVE) == "batch"


@pytest.mark.parametrize("value", [" Batch ", "BATCH", "batch"])
def test_header_is_case_and_space_insensitive(value):
    assert resolve_priority(value, None, INTERACTIVE) == "batch"


def test_batch_tenant_cannot_go_interactive():
    assert resolve_priority("interactive", None, BATCH) == "batch"
    assert resolve_priority(None, "interactive", BATCH) == "batch"


@pytest.mark.parametrize("value", ["urgent", "", "0"])
def test_invalid_header_is_400(value):
    r = resolve_priority(value, None, INTERACTIVE)
    assert isinstance(r, Rejection)
    assert (r.status, r.type, r.param) == (400, "invalid_request_error", "priority")
    assert "interactive, batch" in r.message


def test_invalid_header_rejected_even_for_batch_tenant():
    assert isinstance(resolve_priority("urgent", None, BATCH), Rejection)
