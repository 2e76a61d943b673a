"""The console's security properties, over HTTP without a browser: markup from tenant data is
inert, every form needs its CSRF token, a tenant session sees its own tenant only, no key
leaks into a URL, a log line or the audit log, sessions expire and end with their key, and
sign-in attempts are limited per address."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from gateway.console.response_headers import CONTENT_SECURITY_POLICY
from gateway.storage import api_keys, tenants
from gateway.storage.models import AuditEntry
from tests.gateway.console.console_client import ADMIN_KEY, SESSION_TTL_S, Console, console

XSS_NAME = "<img src=x onerror=alert(1)>"
QUOTA_FORM = {
    "budget_money": "",
    "budget_tokens": "",
    "budget_period": "month",
    "rpm": "",
    "tpm": "",
    "max_output_tokens": "",
    "max_prompt_tokens": "",
}


@pytest.fixture
def ui(sqlite_db_url: str) -> Iterator[Console]:
    with console(sqlite_db_url) as found:
        yield found


def tenant_with_key(ui: Console, tenant_id: str) -> str:
    with ui.database.transaction() as session:
        tenants.create_tenant(session, tenant_id, name="", tier="standard", quota={})
        return api_keys.create_key(session, tenant_id, name="k").key


def test_a_tenant_named_as_markup_renders_inert(ui: Console) -> None:
    assert ui.sign_in(ADMIN_KEY).status_code == 303
    created = ui.post("/ui/tenants", {"id": "acme", "name": XSS_NAME}, page="/ui/tenants")
    assert created.status_code == 303
    for path in ("/ui/tenants", "/ui/tenants/acme", "/ui/audit"):
        page = ui.client.get(path)
        assert page.status_code == 200
        assert "<img" not in page.text
        assert "&lt;img src=x onerror=alert(1)&gt;" in page.text
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "script-src" not in CONTENT_SECURITY_POLICY  # default-src 'none': no script
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["x-frame-options"] == "DENY"


def test_every_form_post_without_its_csrf_token_is_refused(ui: Console) -> None:
    key = tenant_with_key(ui, "acme")
    ui.sign_in(ADMIN_KEY)
    with ui.database.session() as session:
        key_id = api_keys.list_keys(session, "acme")[0].id
    forms = {
        "/ui/tenants": {"id": "other", "name": ""},
        "/ui/tenants/acme/quota": {**QUOTA_FORM, "budget_tokens": "100"},
        "/ui/tenants/acme/budgets": {
            "scope": "user",
            "end_user": "u",
            "unit": "tokens",
            "amount": "5",
            "period": "day",
        },
        "/ui/tenants/acme/keys": {"name": "k2"},
        f"/ui/keys/{key_id}/revoke": {},
        "/ui/sign-out": {},
    }
    for path, data in forms.items():
        for token in (None, "forged", ui.csrf("/ui/sign-in")):  # absent, wrong, another form's
            body = data if token is None else {**data, "csrf_token": token}
            refused = ui.client.post(path, data=body, follow_redirects=False)
            assert refused.status_code == 403, (path, token, refused.text)
    with ui.database.session() as session:  # nothing changed
        assert tenants.get_tenant(session, "other") is None
        assert len(api_keys.list_keys(session, "acme")) == 1
        assert session.scalars(select(AuditEntry)).first() is None
    assert ui.get("/ui/tenants").status_code == 200  # still signed in
    # The sign-in form's token is tied to its own cookie: without it, refused too.
    ui.client.cookies.clear()
    refused = ui.client.post("/ui/sign-in", data={"api_key": key}, follow_redirects=False)
    assert refused.status_code == 403


def test_a_tenant_session_reaches_only_its_own_view(ui: Console) -> None:
    key = tenant_with_key(ui, "acme")
    tenant_with_key(ui, "rival")
    signed_in = ui.sign_in(key)
    assert signed_in.status_code == 303
    assert ui.get("/ui/").headers["location"] == "/ui/my"
    own = ui.client.get("/ui/my")
    assert own.status_code == 200
    assert "acme" in own.text
    assert "rival" not in own.text
    for path in (
        "/ui/tenants",
        "/ui/tenants/rival",
        "/ui/tenants/acme",
        "/ui/usage",
        "/ui/usage?tenant=rival",
        "/ui/usage.csv",
        "/ui/fleet",
        "/ui/audit",
    ):
        assert ui.get(path).status_code == 403, path
    for path in ("/ui/my?tenant=rival", "/ui/my/usage.csv?tenant=rival"):
        assert ui.get(path).status_code == 403, path
    token = ui.csrf("/ui/my")
    for path, data in {
        "/ui/tenants": {"id": "mine"},
        "/ui/tenants/rival/keys": {"name": "stolen"},
        "/ui/tenants/acme/quota": {**QUOTA_FORM, "budget_tokens": "999999"},
    }.items():
        refused = ui.client.post(path, data={**data, "csrf_token": token}, follow_redirects=False)
        assert refused.status_code == 403, path
    with ui.database.session() as session:
        assert len(api_keys.list_keys(session, "rival")) == 1
        assert tenants.get_tenant(session, "mine") is None


def test_no_key_in_a_url_a_log_line_or_the_audit_log(
    ui: Console, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tenant_key = tenant_with_key(ui, "acme")
    locations = []
    signed_in = ui.sign_in(ADMIN_KEY)
    locations.append(signed_in.headers["location"])
    created = ui.post("/ui/tenants/acme/keys", {"name": "new"}, page="/ui/tenants/acme")
    assert created.status_code == 201
    new_key = created.text.split('id="new-key-value">', 1)[1].split("<", 1)[0]
    assert api_keys.is_well_shaped(new_key)
    assert created.headers["cache-control"] == "no-store"
    assert new_key not in ui.client.get("/ui/tenants/acme").text  # shown once
    with ui.database.session() as session:
        key_id = next(k.id for k in api_keys.list_keys(session, "acme") if k.name == "new")
    revoked = ui.post(f"/ui/keys/{key_id}/revoke", {}, page="/ui/tenants/acme")
    locations.append(revoked.headers["location"])
    ui.client.cookies.clear()
    tenant_in = ui.sign_in(tenant_key)
    locations.append(tenant_in.headers["location"])
    secrets_ = (ADMIN_KEY, tenant_key, new_key)
    for secret in secrets_:
        assert not any(secret in location for location in locations)
        assert not any(secret in record.getMessage() for record in caplog.records)
        assert secret not in caplog.text
        assert secret not in str(ui.client.cookies)  # nor in a cookie
    with ui.database.session() as session:
        entries = list(session.scalars(select(AuditEntry)))
    assert {entry.action for entry in entries} == {"key.created", "key.revoked"}
    dumped = repr([(e.actor, e.before, e.after, e.target_id) for e in entries])
    assert not any(secret in dumped for secret in secrets_)
    assert api_keys.hash_key(new_key) not in dumped


def test_an_expired_session_is_refused(ui: Console) -> None:
    ui.sign_in(ADMIN_KEY)
    assert ui.get("/ui/tenants").status_code == 200
    ui.clock.advance(SESSION_TTL_S - 1)
    assert ui.get("/ui/tenants").status_code == 200
    ui.clock.advance(1)
    expired = ui.get("/ui/tenants")
    assert expired.status_code == 303
    assert expired.headers["location"] == "/ui/sign-in"
    # A forged cookie is refused the same way.
    ui.client.cookies.set("tw_console", "eyJyIjoiYWRtaW4ifQ.forged", path="/ui")
    assert ui.get("/ui/fleet").status_code == 303


def test_a_tenant_session_ends_with_its_key(ui: Console) -> None:
    key = tenant_with_key(ui, "acme")
    ui.sign_in(key)
    assert ui.get("/ui/my").status_code == 200
    with ui.database.transaction() as session:
        api_keys.revoke_key(session, api_keys.list_keys(session, "acme")[0].id)
    assert ui.get("/ui/my").status_code == 303


def test_the_session_cookie_is_http_only_strict_and_secure_over_tls(sqlite_db_url: str) -> None:
    for base_url, is_secure in (("http://testserver", False), ("https://testserver", True)):
        with console(sqlite_db_url, base_url=base_url) as ui:
            cookie = ui.sign_in(ADMIN_KEY).headers["set-cookie"].split(", tw_")[0]
            attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
            assert {"httponly", "path", "max-age", "samesite"} <= attributes
            assert "samesite=strict" in cookie.lower()
            assert ("secure" in attributes) is is_secure
            page = ui.client.get("/ui/tenants")
            assert ("strict-transport-security" in page.headers) is is_secure


def test_sign_in_attempts_are_limited_per_address(ui: Console) -> None:
    for _ in range(5):
        wrong = ui.sign_in("tw-" + "x" * 43)
        assert wrong.status_code == 401
        assert "neither the admin key" in wrong.text
    limited = ui.sign_in(ADMIN_KEY)  # even the right key, until the window moves
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1
    ui.clock.advance(61)
    assert ui.sign_in(ADMIN_KEY).status_code == 303


def test_sign_out_ends_the_session(ui: Console) -> None:
    ui.sign_in(ADMIN_KEY)
    out = ui.post("/ui/sign-out", {}, page="/ui/tenants")
    assert out.status_code == 303
    assert out.headers["location"] == "/ui/sign-in"
    assert ui.get("/ui/tenants").status_code == 303
