"""An engine that fails a request: the client gets a 502 in OpenAI's format, recorded as an
upstream error; another tenant's request on the same engine is served as usual."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend_engine.core.request import Request
from backend_engine.text.output_processor import OutputProcessor
from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_stack import tenant_key


@pytest.mark.parametrize("is_stream", [False, True])
def test_an_engine_500_reaches_the_client_as_a_502_upstream_error(
    engines: Engines,
    gateway: Callable[..., str],
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    is_stream: bool,
) -> None:
    tenant_id, key = tenant_key(db_url)
    _, other_key = tenant_key(db_url)
    process = OutputProcessor.process

    def failing(self: OutputProcessor, request: Request, logprob: Any) -> Any:
        if request.tenant_id == tenant_id:  # the engines run in this process
            raise RuntimeError("injected failure")
        return process(self, request, logprob)

    monkeypatch.setattr(OutputProcessor, "process", failing)
    base = gateway(settings_for(engines, tmp_path / "gw", db_url))
    body = {
        "model": SMALL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "stream": is_stream,
    }
    with httpx.Client(base_url=base, timeout=60) as client:
        response = client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        assert response.status_code == 502, response.text
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error"
        assert error["code"] == "upstream_error"
        assert "injected" not in error["message"]  # the engine's internals stay inside
        other = client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {other_key}"}
        )
        assert other.status_code == 200, other.text
    (record,) = usage_records(db_url, tenant_id, 1)
    assert record.status.value == "upstream_error"
    assert record.completion_tokens == 0


def test_a_request_the_engine_refuses_is_recorded_as_rejected_with_its_reason(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> None:
    # An image part passes the gateway's checks (it renders no text to count) but the demo
    # engine refuses it: the client gets the engine's 400, and the record says why, as for a
    # refusal at the door, not "upstream_error" (the engine is fine).
    tenant_id, key = tenant_key(db_url, budget_tokens=10_000, budget_period="total")
    base = gateway(settings_for(engines, tmp_path / "gw", db_url))
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    body = {"model": SMALL, "messages": [{"role": "user", "content": [image]}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base, timeout=60) as client:
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 400, response.text
        code = response.json()["error"]["code"]
        budget = client.get("/v1/budget", headers=headers).json()
    (record,) = usage_records(db_url, tenant_id, 1)
    assert record.status.value == "rejected"
    assert record.reject_reason == (code or "engine_refused")
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    assert (budget["used"], budget["reserved"]) == (0, 0)  # the reservation was released
