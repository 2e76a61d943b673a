"""``GET /ready`` says whether the gateway takes new requests; ``/health`` only that it lives."""

from __future__ import annotations

from pathlib import Path

import httpx

from gateway.app import build_gateway
from gateway.settings import GatewaySettings, ModelSettings


async def test_ready_until_draining_while_health_stays_ok(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    model = ModelSettings(name="m", upstreams=("http://127.0.0.1:9",), context_window=64)
    app = build_gateway(
        GatewaySettings(models={"m": model}, data_dir=tmp_path, database_url=sqlite_db_url)
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        ready = await client.get("/ready")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        app.state.readiness.drain()
        ready = await client.get("/ready")
        assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
        assert (await client.get("/health")).status_code == 200
