"""The tenant pages: the quota editor (errors beside their fields, nothing saved), budgets at
each level with the bar of what their window used, keys (last used, revoke), end users by
spend, and every change in the audit log."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import select

from gateway.storage import api_keys, scoped_budgets, tenants
from gateway.storage.models import AuditEntry, UsageStatus
from gateway.storage.usage_store import UsageEntry, insert_usage
from policies.quota import TenantQuota
from tests.gateway.console.console_client import ADMIN_KEY, Console, console

QUOTA = {
    "budget_money": "", "budget_tokens": "", "budget_period": "month", "rpm": "", "tpm": "",
    "max_output_tokens": "", "max_prompt_tokens": "",
}  # fmt: skip
PAGE = "/ui/tenants/acme"


@pytest.fixture
def ui(sqlite_db_url: str) -> Iterator[Console]:
    with console(sqlite_db_url) as found:
        found.sign_in(ADMIN_KEY)
        assert found.post("/ui/tenants", {"id": "acme", "name": "Acme"}, page="/ui/tenants")
        yield found


def spend(ui: Console, key_id: str | None, end_user: str | None, cost: int, tokens: int) -> None:
    with ui.database.transaction() as session:
        n = len(list(session.execute(select(AuditEntry.id)))) + ui.clock().microsecond
        insert_usage(
            session,
            [
                UsageEntry(
                    request_id=f"r-{key_id}-{end_user}-{cost}-{n}",
                    tenant_id="acme",
                    key_id=key_id,
                    requested_model="m",
                    served_model="m",
                    routing_decision=None,
                    prompt_tokens=tokens,
                    cached_tokens=0,
                    completion_tokens=0,
                    cost_micros=cost,
                    status=UsageStatus.COMPLETED,
                    reject_reason=None,
                    streamed=False,
                    created_at=ui.clock() - timedelta(minutes=1),
                    end_user=end_user,
                )
            ],
        )


def bars(page: str) -> dict[tuple[str, str], float]:
    found = re.findall(
        r'data-level="(\w+)" data-unit="(\w+)">.*?data-used-percent="([\d.]+)"', page, re.S
    )
    return {(level, unit): float(percent) for level, unit, percent in found}


def test_quota_errors_are_shown_beside_their_fields_and_nothing_is_saved(ui: Console) -> None:
    bad = {**QUOTA, "budget_money": "1.2345678", "rpm": "-3", "budget_tokens": "ten"}
    refused = ui.post(f"{PAGE}/quota", bad, page=PAGE)
    assert refused.status_code == 400
    for field in ("budget_money", "rpm", "budget_tokens"):
        assert f'id="error-{field}"' in refused.text
    assert 'id="error-tpm"' not in refused.text
    assert 'value="1.2345678"' in refused.text  # what was typed comes back to be fixed
    with ui.database.session() as session:
        stored = tenants.get_tenant(session, "acme")
    assert stored is not None
    assert stored.quota == TenantQuota().to_dict()  # as created: nothing saved


def test_a_money_budget_and_a_key_budget_show_their_bars(ui: Console) -> None:
    saved = ui.post(f"{PAGE}/quota", {**QUOTA, "budget_money": "2.50"}, page=PAGE)
    assert saved.status_code == 303
    created = ui.post(f"{PAGE}/keys", {"name": "ci"}, page=PAGE)
    assert created.status_code == 201
    assert 'id="new-key"' in created.text
    with ui.database.session() as session:
        key_id = api_keys.list_keys(session, "acme")[0].id
    budget = {"scope": "key", "key_id": key_id, "unit": "tokens", "amount": "1000", "period": "day"}
    assert ui.post(f"{PAGE}/budgets", budget, page=PAGE).status_code == 303
    user = {
        "scope": "user",
        "end_user": "alice",
        "unit": "money",
        "amount": "0.5",
        "period": "total",
    }
    assert ui.post(f"{PAGE}/budgets", user, page=PAGE).status_code == 303
    with ui.database.session() as session:
        assert scoped_budgets.get_budget(session, "acme", "user", "alice") is not None
    spend(ui, key_id, "alice", cost=1_250_000, tokens=400)
    spend(ui, None, "bob", cost=100_000, tokens=50)
    page = ui.client.get(PAGE).text
    assert bars(page) == {
        ("tenant", "micros"): 54.0,  # 1.35 of 2.50
        ("key", "tokens"): 40.0,  # 400 of 1000
        ("user", "micros"): 250.0,  # 1.25 of 0.50: over
    }
    end_users = page.split('id="end-users"', 1)[1]
    assert end_users.index("alice") < end_users.index("bob")  # by spend
    last_used = page.split(f'data-key-id="{key_id}"', 1)[1].split('class="last-used">', 1)[1]
    assert not last_used.startswith("never")
    with ui.database.session() as session:
        actions = [e.action for e in session.scalars(select(AuditEntry).order_by(AuditEntry.id))]
    assert actions == [
        "tenant.created",
        "quota.replaced",
        "key.created",
        "budget.set",
        "budget.set",
    ]


def test_a_budget_form_with_errors_names_its_fields(ui: Console) -> None:
    bad = {"scope": "key", "key_id": "key_nope", "unit": "money", "amount": "0", "period": "week"}
    refused = ui.post(f"{PAGE}/budgets", bad, page=PAGE)
    assert refused.status_code == 400
    for field in ("key_id", "amount", "period"):
        assert f'id="error-{field}"' in refused.text


def test_creating_a_taken_or_malformed_tenant_id_shows_the_error(ui: Console) -> None:
    for tenant_id, message in (("ACME", "is taken"), ("no spaces", "1 to 64 of")):
        refused = ui.post("/ui/tenants", {"id": tenant_id, "name": ""}, page="/ui/tenants")
        assert refused.status_code == 400
        assert 'id="error-id"' in refused.text
        assert message in refused.text


def test_a_revoked_key_shows_as_revoked(ui: Console) -> None:
    ui.post(f"{PAGE}/keys", {"name": "old"}, page=PAGE)
    with ui.database.session() as session:
        key_id = api_keys.list_keys(session, "acme")[0].id
    before = ui.epochs.current_now("acme")
    revoked = ui.post(f"/ui/keys/{key_id}/revoke", {}, page=PAGE)
    assert revoked.status_code == 303
    assert revoked.headers["location"] == PAGE
    row = ui.client.get(PAGE).text.split(f'data-key-id="{key_id}"', 1)[1].split("</tr>", 1)[0]
    assert 'class="state">revoked' in row
    assert "Revoke</button>" not in row
    assert ui.epochs.current_now("acme") != before  # every gateway's key cache is told


def test_alert_thresholds_are_set_with_a_budget_and_with_the_quota(ui: Console) -> None:
    ui.post(f"{PAGE}/keys", {"name": "ci"}, page=PAGE)
    with ui.database.session() as session:
        key_id = api_keys.list_keys(session, "acme")[0].id
    budget = {
        "scope": "key", "key_id": key_id, "unit": "tokens", "amount": "1000", "period": "day",
        "alert_thresholds": "25, 75,100",
    }  # fmt: skip
    assert ui.post(f"{PAGE}/budgets", budget, page=PAGE).status_code == 303
    quota = {**QUOTA, "budget_tokens": "500", "alert_thresholds": "90"}
    assert ui.post(f"{PAGE}/quota", quota, page=PAGE).status_code == 303
    with ui.database.session() as session:
        stored = scoped_budgets.get_budget(session, "acme", "key", key_id)
        tenant = tenants.get_tenant(session, "acme")
    assert stored is not None
    assert stored.alert_thresholds == (25, 75, 100)
    assert tenant is not None
    assert tenant.quota["alert_thresholds"] == [90]
    page = ui.client.get(PAGE).text
    shown = re.findall(r'class="alert-thresholds">([^<]*)<', page)
    assert shown == ["90%", "25%, 75%, 100%"]  # the tenant's, then the key's
    assert 'name="alert_thresholds" value="90"' in page  # the quota editor shows them


@pytest.mark.parametrize("typed", ["80, 50", "50, 50", "0", "1001", "fifty", "50%"])
def test_bad_alert_thresholds_are_shown_beside_the_field(ui: Console, typed: str) -> None:
    budget = {
        "scope": "user", "end_user": "alice", "unit": "tokens", "amount": "10", "period": "day",
        "alert_thresholds": typed,
    }  # fmt: skip
    for path, form in (
        (f"{PAGE}/budgets", budget),
        (f"{PAGE}/quota", {**QUOTA, "alert_thresholds": typed}),
    ):
        refused = ui.post(path, form, page=PAGE)
        assert refused.status_code == 400
        assert 'id="error-alert_thresholds"' in refused.text
        assert "ascending and unique" in refused.text
    with ui.database.session() as session:
        assert scoped_budgets.get_budget(session, "acme", "user", "alice") is None
        stored = tenants.get_tenant(session, "acme")
    assert stored is not None
    assert stored.quota == TenantQuota().to_dict()


def test_money_is_shown_in_the_gateways_currency(sqlite_db_url: str) -> None:
    with console(sqlite_db_url, currency="EUR") as ui:
        ui.sign_in(ADMIN_KEY)
        assert ui.post("/ui/tenants", {"id": "acme", "name": "Acme"}, page="/ui/tenants")
        saved = ui.post(f"{PAGE}/quota", {**QUOTA, "budget_money": "2.50"}, page=PAGE)
        assert saved.status_code == 303
        spend(ui, None, "alice", cost=1_250_000, tokens=400)
        page = ui.client.get(PAGE).text
        row = page.split('data-level="tenant" data-unit="micros">', 1)[1].split("</tr>", 1)[0]
        assert '<td class="used">1.25 EUR</td>' in row
        assert "<td>2.50 EUR</td>" in row  # the limit
        assert 'name="budget_money" value="2.50"' in page  # the editor: the number alone
        assert "Money budget (EUR)" in page
        end_users = page.split('id="end-users"', 1)[1].split("</table>", 1)[0]
        assert "1.25 EUR" in end_users
        assert "1.25 EUR" in ui.client.get("/ui/tenants").text  # spend this month
        exported = ui.client.get("/ui/usage.csv?window=24h&tenant=acme")
        assert exported.text.splitlines()[0].endswith(",total_tokens,cost_micros_EUR")
        assert "Cost by model (EUR)" in ui.client.get("/ui/usage?window=24h").text
