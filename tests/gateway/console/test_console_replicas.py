"""The console behind several gateway replicas: two apps built by `build_gateway` from the same
settings (one database) take each other's sign-in forms, session cookies and CSRF tokens, as
replicas behind one load balancer must; with different session secrets, each refuses the
other's. Sharing Redis, they share one address's sign-in allowance; without it, each counts
its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.app import build_gateway
from gateway.console.console_session import SESSION_COOKIE, SIGN_IN_COOKIE
from gateway.console.console_settings import DEFAULT_SIGN_IN_ATTEMPTS_PER_MINUTE
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import hash_key
from tests.gateway.console.console_client import ADMIN_KEY, CSRF

SECRET = "s" * 43
OTHER_SECRET = "o" * 43


def replica_settings(db_url: str, data_dir: Path, **more: Any) -> GatewaySettings:
    return GatewaySettings.from_dict(
        {
            "database_url": db_url,
            "data_dir": str(data_dir),
            "admin_key_hash": hash_key(ADMIN_KEY),
            "health_check_interval_s": 0,
            "models": {"m": {"upstreams": ["http://127.0.0.1:9"], "context_window": 4096}},
            **more,
        }
    )


@contextmanager
def replicas(*settings: GatewaySettings) -> Iterator[list[TestClient]]:
    """One running gateway (lifespan included) per settings, each with its own client."""
    with ExitStack() as stack:
        yield [stack.enter_context(TestClient(build_gateway(s))) for s in settings]


def csrf_of(client: TestClient, path: str) -> str:
    """The CSRF token of the forms ``client`` gets on ``path``."""
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = CSRF.search(page.text)
    assert found is not None, page.text
    return found.group(1)


def sign_in_across(form_from: TestClient, post_to: TestClient) -> int:
    """Fetch the sign-in form from one replica and post it to another (no sticky sessions):
    the answer's status (303: signed in, with the session cookie in ``post_to``'s jar)."""
    token = csrf_of(form_from, "/ui/sign-in")
    carry(form_from, post_to, SIGN_IN_COOKIE)
    answer = post_to.post(
        "/ui/sign-in", data={"api_key": ADMIN_KEY, "csrf_token": token}, follow_redirects=False
    )
    return answer.status_code


def carry(source: TestClient, target: TestClient, name: str) -> None:
    """The browser's cookie ``name`` from ``source``'s jar, alone in ``target``'s."""
    value = source.cookies[name]
    target.cookies.clear()
    target.cookies.set(name, value)


def test_replicas_sharing_the_secret_take_each_others_sessions(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    settings = [
        replica_settings(sqlite_db_url, tmp_path / name, console={"session_secret": SECRET})
        for name in ("a", "b")
    ]
    with replicas(*settings) as (a, b):
        assert sign_in_across(a, b) == 303
        carry(b, a, SESSION_COOKIE)  # the session b issued, shown to a
        token = csrf_of(a, "/ui/tenants")  # a form a rendered for it ...
        created = b.post(  # ... posted to b
            "/ui/tenants",
            data={"id": "acme", "name": "Acme", "csrf_token": token},
            follow_redirects=False,
        )
        assert created.status_code == 303, created.text
        assert created.headers["location"].endswith("/ui/tenants/acme")
        assert "Acme" in a.get("/ui/tenants/acme").text


def test_replicas_with_different_secrets_refuse_each_others_sessions(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    a_settings = replica_settings(sqlite_db_url, tmp_path / "a", console={"session_secret": SECRET})
    b_env = {"TOLLWAY_CONSOLE_SESSION_SECRET": OTHER_SECRET}
    b_settings = GatewaySettings.from_dict(
        {
            "database_url": sqlite_db_url,
            "data_dir": str(tmp_path / "b"),
            "admin_key_hash": hash_key(ADMIN_KEY),
            "health_check_interval_s": 0,
            "console": {"session_secret": SECRET},  # the environment's wins
            "models": {"m": {"upstreams": ["http://127.0.0.1:9"], "context_window": 4096}},
        },
        env=b_env,
    )
    with replicas(a_settings, b_settings) as (a, b):
        assert sign_in_across(a, b) == 403
        assert sign_in_across(a, a) == 303
        token = csrf_of(a, "/ui/tenants")
        carry(a, b, SESSION_COOKIE)
        page = b.get("/ui/tenants", follow_redirects=False)
        assert (page.status_code, page.headers["location"]) == (303, "/ui/sign-in")
        refused = b.post(
            "/ui/tenants",
            data={"id": "acme", "name": "Acme", "csrf_token": token},
            follow_redirects=False,
        )
        assert (refused.status_code, refused.headers["location"]) == (303, "/ui/sign-in")
        assert a.get("/ui/tenants/acme").status_code == 404


def attempt(client: TestClient) -> int:
    """One sign-in attempt with a wrong key: its status (401 while the allowance lasts)."""
    token = csrf_of(client, "/ui/sign-in")
    answer = client.post(
        "/ui/sign-in", data={"api_key": "wrong", "csrf_token": token}, follow_redirects=False
    )
    return answer.status_code


@pytest.mark.parametrize("shares_redis", [True, False])
def test_sign_in_attempts_are_counted_across_replicas_sharing_redis(
    sqlite_db_url: str, tmp_path: Path, shares_redis: bool, request: pytest.FixtureRequest
) -> None:
    more = {"redis_url": request.getfixturevalue("redis_url")} if shares_redis else {}
    settings = [
        replica_settings(sqlite_db_url, tmp_path / name, console={"session_secret": SECRET}, **more)
        for name in ("a", "b")
    ]
    limit = DEFAULT_SIGN_IN_ATTEMPTS_PER_MINUTE
    with replicas(*settings) as (a, b):
        statuses = [attempt(a if i % 2 else b) for i in range(limit)]
        assert statuses == [401] * limit
        refused = [attempt(a), attempt(b)]  # one address, the allowance spent across both
        assert refused == ([429, 429] if shares_redis else [401, 401])


def test_sign_in_is_refused_while_redis_cannot_count_attempts(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    settings = replica_settings(
        sqlite_db_url, tmp_path / "a", redis_url=f"unix://{tmp_path}/no-redis.sock"
    )
    with replicas(settings) as (a,):
        token = csrf_of(a, "/ui/sign-in")
        answer = a.post(
            "/ui/sign-in", data={"api_key": ADMIN_KEY, "csrf_token": token}, follow_redirects=False
        )
        assert (answer.status_code, answer.headers["retry-after"]) == (503, "1")
        assert "cannot be counted" in answer.text
        assert SESSION_COOKIE not in answer.cookies
