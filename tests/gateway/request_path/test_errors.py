"""Every refusal answers in OpenAI's error format, with the right status and headers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_stack import tenant_key

MESSAGES = [{"role": "user", "content": "Hello there"}]


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"].startswith("req_")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]
    return dict(error)


@pytest.fixture
def client(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> Iterator[httpx.Client]:
    settings = settings_for(engines, tmp_path / "gw", db_url, max_body_bytes=4096)
    with httpx.Client(base_url=gateway(settings), timeout=60) as http:
        yield http


def post(
    client: httpx.Client, key: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **(headers or {})}
    if isinstance(body, bytes):
        return client.post("/v1/chat/completions", headers=headers, content=body)
    return client.post("/v1/chat/completions", headers=headers, json=body)


def test_401_without_or_with_a_wrong_key(client: httpx.Client) -> None:
    body = {"model": SMALL, "messages": MESSAGES}
    assert_openai_error(client.post("/v1/chat/completions", json=body), 401, "invalid_api_key")
    assert_openai_error(post(client, "tw-nope", body), 401, "invalid_api_key")
    assert_openai_error(client.get("/v1/models"), 401, "invalid_api_key")


def test_404_unknown_model_and_403_model_not_allowed(client: httpx.Client, db_url: str) -> None:
    tenant_id, key = tenant_key(db_url, allowed_models=[SMALL])
    error = assert_openai_error(
        post(client, key, {"model": "gpt-9", "messages": MESSAGES}), 404, "model_not_found"
    )
    assert error["param"] == "model"
    assert error["type"] == "invalid_request_error"  # OpenAI's, for an unknown model
    assert error["message"] == "The model `gpt-9` does not exist or you do not have access to it."
    assert_openai_error(
        post(client, key, {"model": "tiny-large", "messages": MESSAGES}), 403, "model_not_allowed"
    )
    records = usage_records(db_url, tenant_id, 2)
    assert sorted(r.reject_reason for r in records) == ["model_not_allowed", "model_not_found"]
    assert all(r.status.value == "rejected" and r.prompt_tokens == 0 for r in records)


def test_a_model_card_is_retrieved_only_for_a_model_the_key_may_use(
    client: httpx.Client, db_url: str
) -> None:
    _, key = tenant_key(db_url, allowed_models=[SMALL, "auto"])
    auth = {"authorization": f"Bearer {key}"}
    for name in (SMALL, "auto"):
        card = client.get(f"/v1/models/{name}", headers=auth)
        assert card.status_code == 200, card.text
        assert card.json() == {"id": name, "object": "model", "created": 0, "owned_by": "tollway"}
    for name in ("tiny-large", "gpt-9", "org/model", "tiny/"):  # not allowed, or not served
        error = assert_openai_error(
            client.get(f"/v1/models/{name}", headers=auth), 404, "model_not_found"
        )
        assert error["type"] == "invalid_request_error"
        assert (
            error["message"]
            == f"The model `{name}` does not exist or you do not have access to it."
        )
    assert_openai_error(client.get(f"/v1/models/{SMALL}"), 401, "invalid_api_key")


def test_400_malformed_and_mistyped_bodies_and_413(client: httpx.Client, db_url: str) -> None:
    _, key = tenant_key(db_url)
    assert_openai_error(post(client, key, b"{not json"), 400, "invalid_json")
    assert_openai_error(post(client, key, b"[1, 2]"), 400, "invalid_json")
    error = assert_openai_error(
        post(client, key, {"model": SMALL, "messages": "hi"}), 400, "invalid_request"
    )
    assert error["param"] == "messages"
    assert_openai_error(
        post(client, key, {"model": SMALL, "messages": MESSAGES, "max_tokens": "5"}),
        400,
        "invalid_type",
    )
    assert_openai_error(
        post(client, key, {"model": SMALL, "messages": MESSAGES, "stream": "yes"}),
        400,
        "invalid_type",
    )
    big = {"model": SMALL, "messages": [{"role": "user", "content": "x" * 10_000}]}
    assert_openai_error(post(client, key, big), 413, "request_too_large")


def test_400_context_length_exceeded(client: httpx.Client, db_url: str) -> None:
    _, key = tenant_key(db_url, max_prompt_tokens=10)
    long = [{"role": "user", "content": "many words here " * 20}]
    error = assert_openai_error(
        post(client, key, {"model": SMALL, "messages": long}), 400, "context_length_exceeded"
    )
    assert error["type"] == "invalid_request_error"
    _, other = tenant_key(db_url)
    assert_openai_error(
        post(client, other, {"model": SMALL, "messages": MESSAGES, "max_tokens": 5000}),
        400,
        "context_length_exceeded",
    )


def test_429_rate_limit_with_retry_after_and_headers(client: httpx.Client, db_url: str) -> None:
    _, key = tenant_key(db_url, rpm=1)
    ok = post(client, key, {"model": SMALL, "messages": MESSAGES, "max_tokens": 1})
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "1"
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    refused = post(client, key, {"model": SMALL, "messages": MESSAGES, "max_tokens": 1})
    error = assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    assert "x-ratelimit-reset-requests" in refused.headers


def test_429_insufficient_quota(client: httpx.Client, db_url: str) -> None:
    tenant_id, key = tenant_key(db_url, budget_tokens=30, budget_period="total")
    refused = post(client, key, {"model": SMALL, "messages": MESSAGES, "max_tokens": 100})
    error = assert_openai_error(refused, 429, "insufficient_quota")
    assert error["type"] == "insufficient_quota"
    records = usage_records(db_url, tenant_id, 1)
    assert records[0].reject_reason == "insufficient_quota"


def test_400_bad_priority_header(client: httpx.Client, db_url: str) -> None:
    _, key = tenant_key(db_url)
    refused = post(
        client, key, {"model": SMALL, "messages": MESSAGES}, headers={"x-priority": "urgent"}
    )
    assert_openai_error(refused, 400, "invalid_value")
