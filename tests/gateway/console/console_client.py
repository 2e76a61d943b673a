"""A console on its own (`build_console` mounted at ``/ui``) over a migrated SQLite file, with
a clock the test moves, driven by Starlette's TestClient: what the console tests share."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import httpx
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from gateway.auth.epochs import MemoryAuthEpochs
from gateway.console.console_app import MOUNT_PATH, build_console
from gateway.console.console_settings import ConsoleSettings
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database

ADMIN_KEY = "admin-" + "c" * 40
START = datetime(2026, 11, 20, 12, 0, tzinfo=timezone.utc)
SESSION_TTL_S = 3600.0
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@dataclass
class Clock:
    now: datetime = START

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@dataclass
class Console:
    client: TestClient
    database: Database
    clock: Clock
    epochs: MemoryAuthEpochs
    urls: list[str] = field(default_factory=list)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path, follow_redirects=False)

    def csrf(self, path: str) -> str:
        """The CSRF token of the forms on ``path``."""
        page = self.client.get(path)
        assert page.status_code == 200, page.text
        found = CSRF.search(page.text)
        assert found is not None, page.text
        return found.group(1)

    def sign_in(self, key: str, *, follow: bool = False) -> httpx.Response:
        token = self.csrf("/ui/sign-in")
        return self.client.post(
            "/ui/sign-in", data={"api_key": key, "csrf_token": token}, follow_redirects=follow
        )

    def post(self, path: str, data: dict[str, str], *, page: str) -> httpx.Response:
        """POST a form of ``page`` with that page's CSRF token."""
        return self.client.post(
            path, data={**data, "csrf_token": self.csrf(page)}, follow_redirects=False
        )


def gateway_settings(database_url: str, currency: str = "USD") -> GatewaySettings:
    return GatewaySettings.from_dict(
        {
            "database_url": database_url,
            "currency": currency,
            "admin_key_hash": hash_key(ADMIN_KEY),
            "models": {"m": {"upstreams": ["http://127.0.0.1:9"], "context_window": 4096}},
        }
    )


@contextmanager
def console(
    database_url: str, *, base_url: str = "http://testserver", currency: str = "USD"
) -> Iterator[Console]:
    database = Database(database_url)
    clock, epochs = Clock(), MemoryAuthEpochs()
    app = build_console(
        gateway_settings(database_url, currency),
        database,
        epochs,
        settings=ConsoleSettings(session_ttl_s=SESSION_TTL_S, sign_in_attempts_per_minute=5),
        now=clock,
    )
    root = Starlette(routes=[Mount(MOUNT_PATH, app=app)])
    with TestClient(root, base_url=base_url) as client:
        yield Console(client, database, clock, epochs)
    database.dispose()
