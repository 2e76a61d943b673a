"""A replica that fails before the first token is skipped; the request succeeds elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.settings import GatewaySettings
from tests.gateway.request_path.conftest import METRICS_AUTH, SMALL, Engines, settings_for
from tests.support.stand_in_stack import tenant_key


def with_dead_replica_first(
    engines: Engines, tmp_path: Path, db_url: str, **overrides: float
) -> GatewaySettings:
    """The engines' settings with a Unix socket nobody listens on as ``SMALL``'s first replica."""
    base_settings = settings_for(engines, tmp_path / "gw", db_url)
    dead = f"unix:{tmp_path}/dead.sock"
    models = dict(base_settings.models)
    models[SMALL] = type(models[SMALL])(
        name=SMALL,
        upstreams=(dead, *models[SMALL].upstreams),
        context_window=models[SMALL].context_window,
        checkpoint=models[SMALL].checkpoint,
        replica_policy="round_robin",  # every other request starts on the dead replica
    )
    return GatewaySettings(
        models=models,
        data_dir=base_settings.data_dir,
        database_url=db_url,
        metrics_token_hash=base_settings.metrics_token_hash,
        **overrides,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("health_check_interval_s", [0.0, 3600.0])
def test_dead_replica_is_skipped(
    engines: Engines,
    gateway: Callable[..., str],
    db_url: str,
    tmp_path: Path,
    health_check_interval_s: float,
) -> None:
    """Without active checks the pool tries the dead replica and retries on the live one
    (round-robin starts on it every other request); with them, the check at start-up has
    found it not ready and no request goes there at all."""
    settings = with_dead_replica_first(
        engines, tmp_path, db_url, health_check_interval_s=health_check_interval_s
    )
    base = gateway(settings)
    _, key = tenant_key(db_url)
    with httpx.Client(base_url=base, timeout=60) as client:
        for stream in (False, True, False, True):  # round-robin starts on each replica
            response = client.post(
                "/v1/completions",
                headers={"authorization": f"Bearer {key}"},
                json={"model": SMALL, "prompt": "hi", "max_tokens": 2, "stream": stream},
            )
            assert response.status_code == 200, response.text
        metrics = client.get("/metrics", headers=METRICS_AUTH).text
    if health_check_interval_s == 0:
        assert 'tollway_gateway_upstream_errors_total{model="tiny",version="tiny"} 2.0' in metrics
        assert 'tollway_gateway_healthy_replicas{model="tiny"} 2.0' in metrics
    else:
        assert "tollway_gateway_upstream_errors_total{" not in metrics
        assert 'tollway_gateway_healthy_replicas{model="tiny"} 1.0' in metrics
