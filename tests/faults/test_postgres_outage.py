"""PostgreSQL stopped for longer than the key cache's lifetime: keys verified before keep
working (up to ``auth_stale_ttl_s``), a key revoked before the outage is refused at once
(Redis is up), a key never seen gets a 503, usage records wait in the spill file and land
once PostgreSQL is back; never a 500."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import httpx
from sqlalchemy import func, select

from gateway.app import SPILL_FILENAME
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.models import UsageRecord, UsageStatus
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL

ADMIN_KEY = "admin-key-for-fault-tests"
CACHE_TTL_S = 1.0
OUTAGE_S = 3 * CACHE_TTL_S  # every cached key is read again, and fails, during the outage
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def completed_records(database_url: str, tenant_ids: list[str]) -> int:
    database = Database(database_url)
    try:
        with database.session() as session:
            count = session.scalar(
                select(func.count())
                .select_from(UsageRecord)
                .where(
                    UsageRecord.tenant_id.in_(tenant_ids),
                    UsageRecord.status == UsageStatus.COMPLETED,
                )
            )
        return int(count or 0)
    finally:
        database.dispose()


def test_verified_keys_outlive_a_postgres_outage_and_records_land_afterwards(
    postgres_process: Any,
    redis_process: Any,
    gateway_settings: Callable[..., GatewaySettings],
    serve_gateway: Callable[[GatewaySettings], str],
    make_tenant: Callable[..., tuple[str, str]],
) -> None:
    settings = gateway_settings(
        database_url=postgres_process.url,
        redis_url=redis_process.url,
        auth_cache_ttl_s=CACHE_TTL_S,
        auth_stale_ttl_s=60,
        admin_key_hash=hashlib.sha256(ADMIN_KEY.encode()).hexdigest(),
    )
    base_url = serve_gateway(settings)
    tenant_a, key_a = make_tenant(postgres_process.url)
    tenant_b, key_b = make_tenant(postgres_process.url)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=base_url, timeout=30) as client:

        def chat(key: str) -> httpx.Response:
            headers = {"authorization": f"Bearer {key}"}
            return client.post("/v1/chat/completions", json=CHAT, headers=headers)

        created = client.post(f"/admin/tenants/{tenant_a}/keys", json={}, headers=admin).json()
        revoked_key, revoked_id = created["key"], created["id"]
        never_seen = client.post(f"/admin/tenants/{tenant_b}/keys", json={}, headers=admin)
        num_completed = 0
        for key in (key_a, key_b, revoked_key):
            assert chat(key).status_code == 200
            num_completed += 1
        assert client.delete(f"/admin/keys/{revoked_id}", headers=admin).status_code == 200
        assert chat(key_a).status_code == 200  # sees tenant A's new epoch, reloads under it
        num_completed += 1

        postgres_process.stop()
        try:
            outage_ends = time.monotonic() + OUTAGE_S
            answers: dict[str, list[int]] = {"a": [], "b": [], "revoked": [], "never_seen": []}
            while time.monotonic() < outage_ends:
                answers["a"].append(chat(key_a).status_code)
                answers["b"].append(chat(key_b).status_code)
                answers["revoked"].append(chat(revoked_key).status_code)
                answers["never_seen"].append(chat(never_seen.json()["key"]).status_code)
                time.sleep(0.05)
            spilled = (settings.data_dir / SPILL_FILENAME).read_text().count("\n")
            tenant_a_key = {"authorization": f"Bearer {key_a}"}
            side_answers = {
                "admin_read": client.get("/admin/tenants", headers=admin).status_code,
                "usage": client.get("/v1/usage", headers=tenant_a_key).status_code,
            }
        finally:
            postgres_process.start()

        assert set(answers["a"]) == {200}, answers
        assert set(answers["b"]) == {200}, answers
        assert set(answers["revoked"]) == {503}, answers
        assert set(answers["never_seen"]) == {503}, answers
        assert side_answers == {"admin_read": 503, "usage": 503}
        num_completed += len(answers["a"]) + len(answers["b"])
        assert spilled >= len(answers["a"]) + len(answers["b"])

        wait_until(  # the writer backs off up to 10 s between tries
            lambda: completed_records(postgres_process.url, [tenant_a, tenant_b]) == num_completed,
            30,
            f"{num_completed} completed records",
        )
        time.sleep(CACHE_TTL_S)
        assert chat(revoked_key).status_code == 401
        assert chat(key_a).status_code == 200
